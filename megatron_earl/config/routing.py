"""Routing replay for mixture-of-experts models (``routing``).

    routing:
      replay: rollout                 # none (default) | rollout
      phases: [experience, train]     # the forwards that replay (with replay: rollout)
      measure: true                   # record routes to report the disagreement without replay

``rollout``: the rollout engine returns, for every position it computed, the experts it routed
the token to (``return_routed_experts``); the trajectory keeps them with its tokens, the samples
carry them (``routed_experts``, per token, through dispatch, packing and the context-parallel
split) and the forwards of ``phases`` route each token to exactly those experts
(megatron-core's ``RouterReplay``; ``models.routing``). Without it, the trainer's routers take
their own top-k, which can differ from the engine's where two router logits are close: the
log-probabilities the loss compares (rollout vs train) then come from different experts.
``measure``: with replay off, still ask for the routes and report how often the trainer's own
routing differs from the engine's (``routing/disagreement``). docs/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_earl.config.vocab import Phase, RoutingReplay, member


class RoutingConfigError(ValueError):
    """An invalid ``routing`` section."""


REPLAY_PHASES = (Phase.EXPERIENCE, Phase.TRAIN)
"""The phases whose forwards can replay routes (the rollout records them)."""


@dataclass(frozen=True)
class RoutingConfig:
    """Routing replay of an MoE model (module docstring)."""

    replay: RoutingReplay = RoutingReplay.NONE
    """ "none" or "rollout" (``RoutingReplay``)."""
    phases: tuple[Phase, ...] = REPLAY_PHASES
    """The forwards that replay the rollout's routes (``replay: rollout``): experience (old and
    reference log-probs), train."""
    measure: bool = False
    """Ask the engine for routes with ``replay: none`` too, and report the disagreement."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        object.__setattr__(self, "replay", member(RoutingReplay, self.replay, problems, "replay"))
        phases = tuple(member(Phase, p, problems, "phase") for p in self.phases)
        object.__setattr__(self, "phases", phases)
        bad = [str(p) for p in phases if isinstance(p, Phase) and p not in REPLAY_PHASES]
        if bad:
            problems.append(
                f"phases {bad} cannot replay routes; valid: {[str(p) for p in REPLAY_PHASES]}"
            )
        if len(set(phases)) != len(phases):
            problems.append(f"phases {[str(p) for p in phases]} name a phase twice")
        if problems:
            raise RoutingConfigError("; ".join(problems))

    @property
    def records(self) -> bool:
        """Whether the rollout asks the engine for routes."""
        return self.replay is RoutingReplay.ROLLOUT or self.measure

    def replays(self, phase: Phase) -> bool:
        """Whether ``phase``'s forwards replay the rollout's routes."""
        return self.replay is RoutingReplay.ROLLOUT and phase in self.phases
