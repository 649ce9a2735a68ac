"""The prompts of a rollout and their groups, whatever engine generates them
(``orchestration.engines``).

Prompts are split between the rollout's drivers deterministically (prompt i -> driver i % n: a DP
replica of the rollout layout on the embedded engine, a rank with SGLang engines), so every rank
knows which prompts (and so which groups) each driver holds without talking. A group's
trajectories stay on the driver that generated them (GRPO baselines are computed there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from megatron_earl.config.run import RunConfig
from megatron_earl.rollout.agent.loop import AgentLoopConfig, RolloutTask
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
    first_index: int = 0
    """Index of the first prompt's group: group ids are ``<tag>-<first_index + i>`` (a step's
    extra rounds under ``rollout.dynamic_sampling`` continue its numbering)."""

    def tasks_for(self, replica: int, num_replicas: int) -> list[RolloutTask]:
        return [
            RolloutTask(self.env, seed, group_id=f"{self.tag}-{self.first_index + i}")
            for i, seed in enumerate(self.seeds)
            if i % num_replicas == replica
        ]


def agent_config(
    config: RunConfig, *, group_size: int, temperature: float, seed: int, train: bool = True
) -> AgentLoopConfig:
    """The agent loop's settings of one rollout of the run: ``rollout``'s limits and its
    ``sampling`` whole at ``temperature`` (the run's, or the evaluation's), ``group_size``
    samples per prompt, ``seed`` the rollout's sampling seed (with ``rollout.sampling.seed``,
    the root of every request's seed); a rollout that is trained on (``train``) asks for the
    routed experts when ``routing`` records them. Pure."""
    r = config.rollout
    return AgentLoopConfig(
        max_turns=r.max_turns,
        max_context_tokens=r.max_context,
        group_size=group_size,
        sampling=replace(r.sampling, temperature=temperature),
        sampling_seed=seed,
        max_concurrency_per_engine=r.max_concurrency,
        env_timeout_s=r.env_timeout_s,
        reward_timeout_s=r.reward_timeout_s,
        routed_experts=(
            (config.model.num_layers, config.model.moe_router_topk, config.model.num_experts)
            if train and config.routing.records
            else None
        ),
    )


def group_index(trajectories: Sequence[Trajectory]) -> dict[str, int]:
    """Integer ids of the groups of a step, stable on every rank (tag-i -> i)."""
    return {t.group_id: int(t.group_id.rsplit("-", 1)[1]) for t in trajectories}
