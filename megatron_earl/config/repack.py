"""Where asynchronous trajectories run between weight versions (``rollout.repack``).

    rollout:
      mode: async
      engine_urls: [http://127.0.0.1:31000, http://127.0.0.1:31001]
      sglang:
        weight_update: relay
        relay_urls: [http://127.0.0.1:31010]
        engine_relays: [http://127.0.0.1:31011, http://127.0.0.1:31012]  # relay of each engine
      repack:
        policy: repack        # none (default) | drain | repack
        below: 2              # a draining engine holding <= 2 trajectories gives them away
        max_per_engine: 64

``none``: engines take each new version when their relay has it (or when the trainer pushes),
in-flight trajectories go on under it (``rollout.partial_rollout``). ``drain``: every trajectory
runs on one weight version -- an engine behind the newest version takes no new trajectory and
is loaded once none is left on it. ``repack``: ``drain``, and the few trajectories left on a
draining engine move to another engine on the same version (their next turn is prefilled
there from their tokens), so the freed engine is loaded and starts new prompts (Laminar's
long-tail repack). ``rollout/repack.py`` implements it; ``docs/relay.md`` says what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_earl.config.vocab import RepackPolicy


class RepackConfigError(ValueError):
    """An invalid ``rollout.repack`` section."""


@dataclass(frozen=True)
class RepackConfig:
    """Trajectory placement across weight versions in ``rollout.mode: async``."""

    policy: RepackPolicy = RepackPolicy.NONE
    """ "none", "drain" or "repack" (``RepackPolicy``, module docstring)."""
    below: int = 2
    """repack: a draining engine holding at most this many of a rank's trajectories moves them
    to the lowest-index engine on the same version that holds that rank's trajectories."""
    max_per_engine: int = 64
    """repack: trajectories of one rank an engine receiving a repack may then hold at most."""
    interval_s: float = 0.1
    """How often each rank's producer reads the draining engines' versions, releases empty
    ones to their relays and plans a repack."""

    def __post_init__(self) -> None:
        problems = []
        try:
            object.__setattr__(self, "policy", RepackPolicy(self.policy))
        except ValueError:
            problems.append(f"policy {self.policy!r} is not one of {tuple(RepackPolicy)}")
        if isinstance(self.below, bool) or not isinstance(self.below, int) or self.below < 1:
            problems.append(f"below ({self.below!r}) must be an integer >= 1")
        if (
            isinstance(self.max_per_engine, bool)
            or not isinstance(self.max_per_engine, int)
            or self.max_per_engine < 1
        ):
            problems.append(f"max_per_engine ({self.max_per_engine!r}) must be an integer >= 1")
        if not isinstance(self.interval_s, int | float) or not self.interval_s > 0:
            problems.append(f"interval_s ({self.interval_s!r}) must be > 0")
        if problems:
            raise RepackConfigError("repack: " + "; ".join(problems))

    @property
    def enabled(self) -> bool:
        return self.policy != RepackPolicy.NONE
