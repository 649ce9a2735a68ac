"""Rollout: engine protocol, embedded engine, SGLang client/launcher, agent loop, environments."""
