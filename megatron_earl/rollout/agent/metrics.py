"""Rollout metrics of a batch of trajectories: counts by status and end reason, rewards,
lengths, versions and timings. ``RolloutMetrics.from_trajectories(trajs, wall_s).to_dict()``
is what the RL loop logs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_earl.rollout.agent.trajectory import Trajectory


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@dataclass
class RolloutMetrics:
    num_trajectories: int = 0
    num_ok: int = 0
    num_failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """FAILED trajectories by end reason (env_error, env_timeout, env_garbage, ...)."""
    end_reasons: dict[str, int] = field(default_factory=dict)
    """All trajectories by end reason."""
    mean_reward: float = 0.0
    """Over OK trajectories."""
    mean_turns: float = 0.0
    mean_response_tokens: float = 0.0
    max_total_tokens: int = 0
    """Longest prompt + response."""
    num_model_tokens: int = 0
    num_observation_tokens: int = 0
    min_weight_version: int | None = None
    max_weight_version: int | None = None
    wall_s: float = 0.0
    """Batch wall time."""
    mean_trajectory_s: float = 0.0
    max_trajectory_s: float = 0.0

    @classmethod
    def from_trajectories(cls, trajs: Sequence[Trajectory], wall_s: float) -> RolloutMetrics:
        ok = [t for t in trajs if t.ok]
        versions = [v for t in trajs for v in t.weight_versions]
        return cls(
            num_trajectories=len(trajs),
            num_ok=len(ok),
            num_failed=len(trajs) - len(ok),
            failures=dict(Counter(t.end_reason.value for t in trajs if not t.ok)),
            end_reasons=dict(Counter(t.end_reason.value for t in trajs if t.end_reason)),
            mean_reward=_mean([t.reward for t in ok]),
            mean_turns=_mean([t.num_turns for t in trajs]),
            mean_response_tokens=_mean([len(t.response_ids) for t in trajs]),
            max_total_tokens=max((len(t.token_ids) for t in trajs), default=0),
            num_model_tokens=sum(sum(t.loss_mask) for t in trajs),
            num_observation_tokens=sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs),
            min_weight_version=min(versions, default=None),
            max_weight_version=max(versions, default=None),
            wall_s=wall_s,
            mean_trajectory_s=_mean([t.wall_s for t in trajs]),
            max_trajectory_s=max((t.wall_s for t in trajs), default=0.0),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
