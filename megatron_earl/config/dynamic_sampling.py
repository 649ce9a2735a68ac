"""Dynamic sampling of informative groups (``rollout.dynamic_sampling``, DAPO's filter).

    rollout:
      dynamic_sampling:
        enabled: true
        metric: reward            # reward (the total) | outcome | a reward.fns name
        tolerance: 0.0            # a group whose values span <= this is uninformative
        oversample_factor: 1.5    # extra prompts per missing group, over the informative rate
        max_extra_rounds: 4       # synchronous loop: generation rounds after the step's own
        max_extra_prompts: 32     # extra prompts per step at most (null: 4 x prompts_per_step)

A group (the ``batch.samples_per_prompt`` trajectories of one prompt) whose ``metric`` values are
all equal within ``tolerance`` has advantage 0 under a group baseline: it is dropped, and the
rollout draws more prompts until the step holds ``batch.prompts_per_step`` informative groups or
the caps are reached (then the step trains on what it has). ``orchestration.dynamic_sampling``
implements it; ``docs/training.md`` ("Dynamic sampling") says how it works. Off by default: a run
without it is the run it was.
"""

from __future__ import annotations

from dataclasses import dataclass

TOTAL_REWARD = "reward"
"""``metric`` naming the trajectory's total reward (what the advantage estimators read)."""
OUTCOME_REWARD = "outcome"
"""``metric`` naming the environment's outcome reward component."""
DEFAULT_EXTRA_PROMPTS_PER_PROMPT = 4
"""``max_extra_prompts: null`` allows this many extra prompts per prompt of the step."""


class DynamicSamplingConfigError(ValueError):
    """An invalid ``rollout.dynamic_sampling`` section."""


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """Drop groups whose rewards are all equal and draw more prompts in their place."""

    enabled: bool = False
    """Drop uninformative groups and refill the step (False: every group trains, as before)."""
    metric: str = TOTAL_REWARD
    """Per-trajectory value whose spread makes a group informative: "reward" (the total reward,
    what the advantages read), "outcome" (the environment's reward) or the name of a remote
    reward function of ``reward.fns`` (checked at start-up)."""
    tolerance: float = 0.0
    """A group is uninformative when max - min of its usable trajectories' ``metric`` is <= this
    (or it has fewer than 2 usable trajectories); >= 0."""
    oversample_factor: float = 1.0
    """An extra round draws ceil(oversample_factor x missing / rate) prompts, where missing is
    the informative groups the step still lacks and rate the informative fraction of the groups
    drawn so far in the step (at least one counted); >= 1."""
    max_extra_rounds: int = 4
    """Synchronous loop: generation rounds after the step's own, at most (>= 1 when
    enabled)."""
    max_extra_prompts: int | None = None
    """Prompts drawn beyond the step's own, per step, at most (>= 1 when enabled; null: 4 x
    ``batch.prompts_per_step``). Asynchronous mode: each rank may drop at most its share of
    this many groups per RL step; past it, uninformative groups are admitted."""
    seed_offset: int = 3_000_000
    """Environment seeds of extra prompts start here: step s draws from its own block of
    ``max_extra_prompts`` seeds, so a step's extra draws never change another step's prompts
    (disjoint from the training, evaluation and SFT seeds)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.metric:
            problems.append("metric must not be empty")
        if not self.tolerance >= 0:
            problems.append(f"tolerance ({self.tolerance}) must be >= 0")
        if not self.oversample_factor >= 1:
            problems.append(
                f"oversample_factor ({self.oversample_factor}) must be >= 1 (1 draws the missing "
                "groups' worth of prompts at the step's informative rate)"
            )
        for name in ("max_extra_rounds", "max_extra_prompts"):
            value = getattr(self, name)
            if value is not None and value < int(self.enabled):
                problems.append(
                    f"{name} ({value}) must be >= 1 with enabled: true (a cap of 0 would drop "
                    "groups without drawing any in their place; to keep every group, set "
                    "enabled: false)"
                )
        if self.seed_offset < 0:
            problems.append(f"seed_offset ({self.seed_offset}) must be >= 0")
        if problems:
            raise DynamicSamplingConfigError("dynamic_sampling: " + "; ".join(problems))

    def extra_prompt_cap(self, prompts_per_step: int) -> int:
        """Extra prompts one step may draw (``max_extra_prompts`` or its default)."""
        if self.max_extra_prompts is not None:
            return self.max_extra_prompts
        return DEFAULT_EXTRA_PROMPTS_PER_PROMPT * prompts_per_step

    def metric_names(self, reward_fns: tuple[str, ...]) -> tuple[str, ...]:
        """The values ``metric`` may name with the run's remote reward functions."""
        return (TOTAL_REWARD, OUTCOME_REWARD, *reward_fns)
