"""Make megatron-core's parallel state describe a ``ParallelLayout``; switch it in-process.

    use_layout(ParallelLayout(tp=2))      # Megatron's globals now describe tp2
    use_layout(ParallelLayout(dp=2))      # ... dp2 (new groups created on first use only)
    use_layout(ParallelLayout(tp=2))      # ... tp2 again: no new group, no collective

How: ``use_layout`` detaches Megatron's globals *without destroying any group* and runs Megatron's
own ``initialize_model_parallel`` with its ``create_group`` routed to the process-group cache
(``megatron_earl.parallel.groups``). Megatron therefore sets every global exactly as it would
(tp/pp/cp/dp/mp, embedding and position-embedding groups, tp-cp, dp-cp, tp-dp(-cp), the expert
groups of ``layout.ep`` / ``layout.expert_tp``,
global rank lists, gloo variants, vpp rank/size, the global memory buffer), while every group
object comes from the cache. Group requests happen in Megatron's order, which depends only on the
layout, so every rank misses (calls ``new_group``) at the same request. Everything that touches
Megatron's internals for this (the routing, the private globals, the RoPE cache) is the patch
``patches/parallel_state_groups.py``.

Around that, a switch:

* clears caches that hold groups or modules: the ``lru_cache`` on ``RotaryEmbedding.forward`` (and
  subclasses) keys on the module and its CP group;
* keeps the global memory buffer (it holds no group) instead of reallocating it;
* re-seeds Megatron's RNG tracker for this rank's new TP/expert ranks on the first entry to a
  layout (Megatron's rule: ``seed + 2718 + tp_rank``; base seed read back from the tracker) and on
  later entries restores the tracker states the layout had when it was left, so dropout streams
  continue where they stopped (unless ``runtime.seed`` changed the base seed meanwhile: then it
  re-seeds);
* builds one ``ProcessGroupCollection`` per layout (``process_groups()``) from the same cached
  groups, for code that takes ``pg_collection=`` explicitly.

Never call ``parallel_state.destroy_model_parallel()`` between switches: it destroys the current
gloo groups, which the cache still holds. ``destroy_layouts()`` tears down exactly the groups the
cache created.
"""

from __future__ import annotations

import gc
from typing import Any

import torch.distributed as dist

from megatron_earl.parallel.groups import group_cache
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.patches import parallel_state_groups

_current: ParallelLayout | None = None
_pg_collections: dict[ParallelLayout, Any] = {}
_rng_states: dict[ParallelLayout, tuple[dict[str, Any], set[int]]] = {}


def current_layout() -> ParallelLayout | None:
    """The layout Megatron's parallel state describes (None before the first ``use_layout``)."""
    return _current


def use_layout(layout: ParallelLayout) -> None:
    """Make Megatron's parallel state describe ``layout`` (replacing any previous layout).

    Every rank of the world calls it with the same layout. Creates process groups only for rank
    sets never requested before (then it is a collective over the world); a layout used before
    needs no communication at all.
    """
    global _current
    from megatron.core import parallel_state

    layout.check_world(dist.get_world_size())
    if layout == _current and parallel_state.model_parallel_is_initialized():
        return
    previous = _current
    _save_rng(previous)
    parallel_state_groups.clear_group_caches()
    memory_buffer = parallel_state_groups.detach(owned=_current is not None)
    with parallel_state_groups.routed_create_group(group_cache()) as member_groups:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expert_tp,
        )
    parallel_state_groups.attach(member_groups, memory_buffer)
    _current = layout
    _restore_or_reseed_rng(layout)


def initialize_layout(layout: ParallelLayout) -> None:
    """Build Megatron's model-parallel state for ``layout`` (same as ``use_layout``).

    Every rank of the world calls it.
    """
    use_layout(layout)


def process_groups() -> Any:
    """The current layout's groups as a ``ProcessGroupCollection`` (the objects Megatron's globals
    hold), for ``pg_collection=`` arguments. One collection per layout, reused on every switch."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if _current is None:
        raise RuntimeError("no layout is active; call megatron_earl.parallel.state.use_layout()")
    collection = _pg_collections.get(_current)
    if collection is None:
        collection = ProcessGroupCollection.use_mpu_process_groups()
        _pg_collections[_current] = collection
    return collection


def destroy_layouts() -> None:
    """Forget every layout and destroy exactly the process groups the cache created.

    Every rank of the world calls it. Models built in any layout must not run afterwards.
    """
    global _current
    from megatron.core import parallel_state

    parallel_state_groups.clear_group_caches()
    if _current is not None:
        parallel_state_groups.detach(owned=True)
    parallel_state.destroy_global_memory_buffer()
    _pg_collections.clear()
    _rng_states.clear()
    _current = None
    group_cache().destroy()
    gc.collect()


# ----------------------------------------------------------------------------- internals


def _save_rng(layout: ParallelLayout | None) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if layout is not None and tracker.is_initialized():
        _rng_states[layout] = (tracker.get_states(), set(tracker.seeds_))


def _restore_or_reseed_rng(layout: ParallelLayout) -> None:
    """Restore ``layout``'s tracker states, or seed them for this rank's ranks in ``layout``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    if not tracker.is_initialized() or not tracker.seeds_:
        return
    # Megatron seeds data-parallel = seed, expert = seed + 1024 + ..., tensor = seed + 2718 + ...:
    # the smallest tracked seed is the base seed.
    seed = min(tracker.seeds_)
    saved = _rng_states.get(layout)
    if saved is not None and min(saved[1]) == seed:
        states, seeds = saved
        tracker.set_states(dict(states))
        tracker.seeds_ = set(seeds)
        return
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
