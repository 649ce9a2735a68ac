"""Agentic multi-turn rollout: the agent loop, the trajectory type, metrics and SFT data.
Guide: ``megatron_earl/docs/agents.md``."""

from __future__ import annotations

from megatron_earl.rollout.agent.loop import AgentLoop, AgentLoopConfig, RolloutBatch, RolloutTask
from megatron_earl.rollout.agent.metrics import RolloutMetrics
from megatron_earl.rollout.agent.sft import assistant_turn_ids, demonstration_tokens, sft_examples
from megatron_earl.rollout.agent.trajectory import (
    EndReason,
    Trajectory,
    TrajectoryStatus,
    TurnRecord,
)

__all__ = [
    "AgentLoop",
    "AgentLoopConfig",
    "EndReason",
    "RolloutBatch",
    "RolloutMetrics",
    "RolloutTask",
    "Trajectory",
    "TrajectoryStatus",
    "TurnRecord",
    "assistant_turn_ids",
    "demonstration_tokens",
    "sft_examples",
]
