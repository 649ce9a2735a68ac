"""Rollout engines behind one interface (``base.RolloutBackend``), one kind per module,
registered by ``rollout.engine`` name and chosen once at start-up (``docs/engines.md``):

    embedded   the Megatron model in the rollout layout, in the trainer's processes
    sglang     SGLang-protocol servers of their own, driven over HTTP from every rank

A kind's module is imported when the kind is first asked for (``rollout_backend_class``); the
start-up checks (``rollout_backend_problems``) import none of them.
"""

from megatron_earl.orchestration.engines.base import (
    Rollout,
    RolloutBackend,
    available_rollout_backends,
    register_rollout_backend,
    rollout_backend_class,
)
from megatron_earl.orchestration.engines.checks import rollout_backend_problems

__all__ = [
    "Rollout",
    "RolloutBackend",
    "available_rollout_backends",
    "register_rollout_backend",
    "rollout_backend_class",
    "rollout_backend_problems",
]
