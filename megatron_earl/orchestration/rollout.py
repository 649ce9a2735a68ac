"""The prompts of a rollout and their groups, whatever engine generates them
(``orchestration.engines``).

Prompts are split between the rollout's drivers deterministically (prompt i -> driver i % n: a DP
replica of the rollout layout on the embedded engine, a rank with SGLang engines), so every rank
knows which prompts (and so which groups) each driver holds without talking. A group's
trajectories stay on the driver that generated them (GRPO baselines are computed there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_earl.rollout.agent.loop import RolloutTask
from megatron_earl.rollout.agent.trajectory import Trajectory


@dataclass(frozen=True)
class PromptSet:
    """The prompts of one rollout: environment spec and task seeds."""

    env: dict
    """Environment spec for ``ENVS`` ({name, kwargs})."""
    seeds: tuple[int, ...]
    """One task seed per prompt."""
    tag: str
    """Prefix of group ids (e.g. "s12" for step 12, "eval")."""

    def tasks_for(self, replica: int, num_replicas: int) -> list[RolloutTask]:
        return [
            RolloutTask(self.env, seed, group_id=f"{self.tag}-{i}")
            for i, seed in enumerate(self.seeds)
            if i % num_replicas == replica
        ]


def group_index(trajectories: Sequence[Trajectory]) -> dict[str, int]:
    """Integer ids of the groups of a step, stable on every rank (tag-i -> i)."""
    return {t.group_id: int(t.group_id.rsplit("-", 1)[1]) for t in trajectories}
