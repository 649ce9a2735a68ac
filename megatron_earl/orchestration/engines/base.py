"""The rollout backend interface the RL loop drives, and the registry of engine kinds.

One backend per run, chosen once at start-up from ``rollout.engine``; the loop calls the same
methods whatever the kind (``docs/engines.md``):

    kind = rollout_backend_class(config.rollout.engine)      # unknown name: ConfigError
    policy = Policy.build(model, kind.policy_layouts(layouts), ...)
    backend = kind(config, policy, tokenizer)
    backend.sync_weights(layout)                  # every step, before generating
    trajectories, source = backend.generate(prompts, agent, layout)
    backend.close()                               # end of the run

A new kind is one module with a ``RolloutBackend`` subclass decorated with
``@register_rollout_backend``, its path in ``BACKEND_MODULES`` (imported the first time the kind
is asked for, so the start-up checks never load an engine's runtime code), its start-up checks in
``engines.checks`` and a member of ``config.vocab.EngineKind`` (``rollout.engine``'s valid names;
``tests/unit/test_rollout_backends.py`` requires the three to name the same kinds).

Which ranks call: every method except the class methods is called by every rank of the world
with the same arguments (SPMD).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from megatron_earl.config.run import ConfigError, RunConfig
from megatron_earl.config.vocab import EngineKind
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.rollout.agent.loop import AgentLoopConfig
from megatron_earl.rollout.agent.trajectory import Trajectory
from megatron_earl.tokenizer.base import ChatTokenizer

if TYPE_CHECKING:
    from megatron_earl.orchestration.policy import Policy
    from megatron_earl.orchestration.rollout import PromptSet


class Rollout(NamedTuple):
    """What this rank holds after a rollout."""

    trajectories: list[Trajectory]
    """The trajectories this rank holds (whole groups; empty on ranks that hold none)."""
    source: int | None
    """This rank's index among the ranks that hold trajectories (distinct per such rank; the
    dispatcher's sample ids start at ``source * SAMPLE_ID_STRIDE``), None on the others."""


class RolloutBackend(ABC):
    """The engines of one run, as the RL loop sees them: weight sync and generation."""

    name: ClassVar[str]
    """The ``rollout.engine`` value that selects this kind."""

    def __init__(self, config: RunConfig, policy: Policy, tokenizer: ChatTokenizer) -> None:
        """Built once per run, after the policy (``policy_layouts``). Every rank builds it."""
        self.config = config
        self.policy = policy
        self.tokenizer = tokenizer

    def rollout_stats(self) -> dict[str, float]:
        """Counters of this rank's last rollout, summed over ranks into ``rollout/<name>``
        metrics (the same keys on every rank); none by default."""
        return {}

    @classmethod
    def policy_layouts(cls, layouts: dict[str, ParallelLayout]) -> dict[str, ParallelLayout]:
        """The phase layouts the job's policy is built in (``Policy.build``): every phase's by
        default; a kind whose engines hold their own weights drops the rollout layout."""
        return dict(layouts)

    @abstractmethod
    def switch(self, layout: ParallelLayout) -> None:
        """Make generating in ``layout`` possible (the selector's switch of the rollout layout,
        timed apart from the phase): activate it, build what is missing there. Every rank."""

    @abstractmethod
    def sync_weights(self, layout: ParallelLayout) -> dict[str, float]:
        """Bring the engines that generate in ``layout`` to the policy's weight version if they
        are behind; returns what that cost (empty when nothing moved; the loop logs each key
        as ``sync/<key>``, ``docs/metrics.md``). Collective (world)."""

    @abstractmethod
    def generate(
        self, prompts: PromptSet, agent: AgentLoopConfig, layout: ParallelLayout
    ) -> Rollout:
        """Run this rank's share of ``prompts`` (``agent.group_size`` samples each) through the
        agent loop on the engines of ``layout``, after ``sync_weights``. Every rank calls."""

    @abstractmethod
    def master_moved(self, old: ParallelLayout, new: ParallelLayout) -> None:
        """The policy's master copy moved from ``old`` to ``new`` (``Policy.move_master``):
        drop what was built over either layout's chunks. Local."""

    @abstractmethod
    def retain(self, layouts: Iterable[ParallelLayout]) -> None:
        """Drop what was built for layouts not in ``layouts`` (the selector's past choices; the
        policy drops its copies of them). Local."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the backend holds outside this process (end of the run). Every rank."""


BACKEND_MODULES: dict[str, str] = {
    EngineKind.EMBEDDED: "megatron_earl.orchestration.engines.embedded",
    EngineKind.SGLANG: "megatron_earl.orchestration.engines.sglang",
}
"""The module of each engine kind, by ``rollout.engine`` name; importing it registers the kind."""

_REGISTRY: dict[str, type[RolloutBackend]] = {}


def register_rollout_backend(cls: type[RolloutBackend]) -> type[RolloutBackend]:
    """Class decorator: make ``cls`` the backend of ``rollout.engine: <cls.name>``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"rollout backend {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available_rollout_backends() -> tuple[str, ...]:
    return tuple(sorted(BACKEND_MODULES))


def rollout_backend_class(name: str) -> type[RolloutBackend]:
    """The backend registered as ``name`` (``rollout.engine``; its module is imported on first
    use); ``ConfigError`` naming the valid ones otherwise."""
    if name not in BACKEND_MODULES:
        raise ConfigError(
            f"rollout.engine {name!r} is not a registered rollout engine; valid: "
            f"{available_rollout_backends()}"
        )
    importlib.import_module(BACKEND_MODULES[name])
    return _REGISTRY[name]
