"""Layout switching: Megatron-Core's parallel state with cached groups and detachable globals.

What: ``megatron_earl.parallel.state.use_layout`` rebuilds Megatron's parallel state in-process for
  another layout, with these four pieces:
  * ``routed_create_group(cache)`` (scoped): while Megatron's ``initialize_model_parallel`` runs,
    ``parallel_state.create_group`` returns groups from the process-group cache instead of creating
    new ones; the original is restored on exit.
  * ``detach()``: sets the gloo-group globals (``_GLOO_GLOBALS``) and
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` to None around Megatron's
    ``destroy_model_parallel`` so that it forgets the groups without destroying them, and returns
    the global memory buffer.
  * ``attach(member_groups, memory_buffer)``: sets ``_global_process_group_list`` to the groups this
    rank belongs to and puts the kept memory buffer back into ``_GLOBAL_MEMORY_BUFFER``.
  * ``clear_group_caches()``: clears the ``lru_cache`` on ``RotaryEmbedding.forward`` (and
    subclasses), which keys on the module and its CP group.
Why: Megatron-Core's parallel state is module globals built once per process, and its teardown
  destroys the gloo groups; switching layouts between phases must neither create a group twice
  (a collective, and leaked memory) nor destroy one the cache still holds.
Versions: megatron-core>=0.16.0,<0.17.0 (globals and ``create_group`` signature as in 0.16.1).
Test: tests/distributed/test_layout_switch.py
  (test_alternating_switches_are_leak_free_and_keep_models_working: no new group on a switch back,
  no leak, models keep working; test_destroy_layouts_destroys_exactly_the_cached_groups)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
_PS = "megatron.core.parallel_state"

# Megatron globals holding gloo groups that ``destroy_model_parallel`` would destroy.
_GLOO_GLOBALS = (
    "_DATA_PARALLEL_GROUP_GLOO",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
)
_CREATE_GROUP = Target(_PS, "create_group")
_GROUP_LIST = Target(_PS, "_global_process_group_list")
_MEMORY_BUFFER = Target(_PS, "_GLOBAL_MEMORY_BUFFER")
_INTRA_PARTIAL_DP_CP = Target(_PS, "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP")
_GLOO = tuple(Target(_PS, name) for name in _GLOO_GLOBALS)
_ROTARY = Target("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding")
TARGETS = (
    _CREATE_GROUP,
    _GROUP_LIST,
    _MEMORY_BUFFER,
    _INTRA_PARTIAL_DP_CP,
    *_GLOO,
    Target(_PS, "initialize_model_parallel"),
    Target(_PS, "destroy_model_parallel"),
    Target(_PS, "model_parallel_is_initialized"),
    Target(_ROTARY.module, "RotaryEmbedding.forward"),
)


def apply() -> bool:
    """Check the targets (this patch is scoped: ``use_layout`` applies it per switch). Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    return False


@contextlib.contextmanager
def routed_create_group(cache: Any) -> Iterator[list[Any]]:
    """Route Megatron's ``create_group`` to ``cache`` (a ``megatron_earl.parallel.groups.
    GroupCache``); yields the list of groups this rank is in. Every rank of the world enters it
    around the same Megatron call (cache misses create groups over the world)."""
    original = _CREATE_GROUP.get()
    members: list[Any] = []
    rank = dist.get_rank()

    def create_group(
        ranks=None,
        timeout=None,
        backend=None,
        pg_options=None,
        use_local_synchronization=False,
        group_desc=None,
    ):
        if use_local_synchronization:
            raise NotImplementedError("cached groups are created with world synchronization")
        ranks = list(range(dist.get_world_size())) if ranks is None else ranks
        group = cache.get(
            ranks, backend=backend, pg_options=pg_options, timeout=timeout, group_desc=group_desc
        )
        if rank in ranks and all(group is not g for g in members):
            members.append(group)
        return group

    _CREATE_GROUP.set(create_group)
    try:
        yield members
    finally:
        _CREATE_GROUP.set(original)


def detach(owned: bool) -> Any:
    """Drop Megatron's references to the current groups and return the global memory buffer so the
    next layout can keep it. ``owned``: the groups came from the cache (``routed_create_group``),
    so none is destroyed; otherwise the state was built outside this project and Megatron's own
    teardown runs. Local."""
    from megatron.core import parallel_state

    buffer = _MEMORY_BUFFER.get()
    if not owned and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        return buffer
    for target in _GLOO:
        target.set(None)
    parallel_state.destroy_model_parallel()
    _INTRA_PARTIAL_DP_CP.set(None)
    return buffer


def attach(member_groups: list[Any], memory_buffer: Any) -> None:
    """After ``initialize_model_parallel`` under ``routed_create_group``: record this rank's groups
    in Megatron's global group list and keep ``memory_buffer`` (when not None). Local."""
    _GROUP_LIST.set([None, *member_groups])
    if memory_buffer is not None:
        _MEMORY_BUFFER.set(memory_buffer)


def clear_group_caches() -> None:
    """Clear megatron-core caches that hold modules or process groups across layouts. Local."""
    pending = [_ROTARY.get()]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        forward = cls.__dict__.get("forward")
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()
