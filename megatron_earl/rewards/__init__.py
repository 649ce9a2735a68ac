"""Rewards: the outcome reward from the environment, the format reward, and reward functions
served by a separate process over HTTP (``rewards.service``)."""

from __future__ import annotations

from megatron_earl.rewards.base import RewardFn, RewardInput, WeightedReward, format_reward

__all__ = ["RewardFn", "RewardInput", "WeightedReward", "format_reward"]
