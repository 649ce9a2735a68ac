"""Orchestration: the RL loop, checkpoints, metrics."""
