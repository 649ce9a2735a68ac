"""Each rollout engine kind's start-up checks: why a config cannot run with it, before any process
group (``cli.train.check_run``: ``megatron-earl train`` before torchrun, every rank, and the launch
scripts' ``cli.check``). Pure; imports none of the engines' runtime code (Megatron-Core, the HTTP
clients), so the launcher's pre-flight does not pay for it.

    problems = rollout_backend_problems(config)       # [] when config.rollout.engine can run it
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_earl.config.embedded import COMPILE_SWITCHES
from megatron_earl.config.run import RunConfig
from megatron_earl.config.vocab import EngineKind, Phase
from megatron_earl.parallel.layout import phase_layout


def _selects_rollout(config: RunConfig) -> bool:
    """Whether the selector chooses the rollout layout per step (else it is pinned)."""
    return config.selector.enabled and Phase.ROLLOUT in config.selector.phases


def embedded_problems(config: RunConfig) -> list[str]:
    """``rollout.engine: embedded``: a tp/dp rollout layout; the compiled decode step on tp1."""
    rollout = phase_layout(config.layouts, Phase.ROLLOUT)
    problems = []
    if rollout.pp > 1 or rollout.cp > 1:
        problems.append(
            f"layouts.rollout '{rollout}': the embedded engine generates with tp and dp only "
            f"(pp={rollout.pp}, cp={rollout.cp}); use e.g. "
            f"'tp{rollout.tp * rollout.pp * rollout.cp}cp1pp1dp{rollout.dp}'"
        )
    embedded = config.rollout.embedded
    for name in COMPILE_SWITCHES:
        if getattr(embedded, name) and rollout.tp > 1 and not _selects_rollout(config):
            problems.append(
                f"rollout.embedded.{name} needs a tp1 rollout layout (the compiled step "
                f"holds no TP collectives), got layouts.rollout '{rollout}'; use "
                f"'tp1cp1pp1dp{rollout.world_size}', let the selector choose the rollout "
                f"layout, or set {name}: false"
            )
    return problems


def sglang_problems(config: RunConfig) -> list[str]:
    """``rollout.engine: sglang``: the engines' URLs; a rollout layout the selector leaves alone."""
    problems = []
    if _selects_rollout(config):
        problems.append(
            f"selector.phases {list(config.selector.phases)} selects the rollout layout, "
            f"which needs rollout.engine=embedded (got {config.rollout.engine!r}); select "
            "'experience' only with SGLang engines"
        )
    if not config.rollout.engine_urls:
        problems.append(
            "rollout.engine=sglang needs rollout.engine_urls (the SGLang servers to drive, "
            "e.g. from scripts/slurm_disaggregated.sbatch); the trainer does not start "
            "colocated SGLang servers itself"
        )
    return problems


CHECKS: dict[str, Callable[[RunConfig], list[str]]] = {
    EngineKind.EMBEDDED: embedded_problems,
    EngineKind.SGLANG: sglang_problems,
}
"""Every engine kind's checks, by ``rollout.engine`` name (``base.BACKEND_MODULES``' keys)."""


def rollout_backend_problems(config: RunConfig) -> list[str]:
    """Why ``config`` cannot start with its engine kind (``rollout.engine`` is an ``EngineKind``:
    the config refuses other names). Pure."""
    return CHECKS[config.rollout.engine](config)
