"""Rollout engines behind one interface (``base.RolloutBackend``), one kind per module,
registered by ``rollout.engine`` name and chosen once at start-up (``docs/engines.md``):

    embedded   the Megatron model in the rollout layout, in the trainer's processes
    sglang     SGLang-protocol servers of their own, driven over HTTP from every rank
"""

from megatron_earl.orchestration.engines import embedded, sglang  # noqa: F401  (registers)
from megatron_earl.orchestration.engines.base import (
    Rollout,
    RolloutBackend,
    available_rollout_backends,
    register_rollout_backend,
    rollout_backend_class,
    rollout_backend_problems,
)

__all__ = [
    "Rollout",
    "RolloutBackend",
    "available_rollout_backends",
    "register_rollout_backend",
    "rollout_backend_class",
    "rollout_backend_problems",
]
