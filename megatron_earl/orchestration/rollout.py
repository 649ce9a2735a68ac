"""The rollout phase on the embedded engine: each DP replica of the rollout layout drives its share
of the step's prompts through the agent loop; TP rank 0 of the replica schedules, its TP peers
compute with it.

Prompts are split by DP replica deterministically (prompt i -> replica i % dp), so every rank
knows which prompts (and so which groups) each replica holds without talking. A group's
trajectories stay on the replica that generated them (GRPO baselines are computed there).

Which ranks call: every rank of the world, with the rollout layout active.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron.core import parallel_state

from megatron_earl.rollout.agent.loop import AgentLoop, AgentLoopConfig, RolloutBatch, RolloutTask
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.rollout.embedded import EmbeddedEngine, run_engine
from megatron_earl.tokenizer.base import ChatTokenizer


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


@dataclass
class RolloutResult:
    """What this rank holds after the rollout: trajectories on TP rank 0 of a replica, none else."""

    trajectories: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    is_source: bool = False
    """True on the ranks that hold trajectories (TP rank 0 of each rollout replica)."""


def run_rollout(
    engine: EmbeddedEngine,
    tokenizer: ChatTokenizer,
    prompts: PromptSet,
    config: AgentLoopConfig,
) -> RolloutResult:
    """Roll out this replica's prompts (``config.group_size`` samples each) on ``engine``."""
    replica = parallel_state.get_data_parallel_rank()
    num_replicas = parallel_state.get_data_parallel_world_size()
    tasks = prompts.tasks_for(replica, num_replicas)

    async def driver(eng: EmbeddedEngine) -> RolloutBatch:
        return await AgentLoop(eng, tokenizer, config).run_batch(tasks)

    batch = run_engine(engine, driver)
    if batch is None:
        return RolloutResult()
    return RolloutResult(batch.trajectories, batch.metrics.to_dict(), is_source=True)


def group_index(trajectories: Sequence[Trajectory]) -> dict[str, int]:
    """Integer ids of the groups of a step, stable on every rank (tag-i -> i)."""
    return {t.group_id: int(t.group_id.rsplit("-", 1)[1]) for t in trajectories}
