"""Make megatron-core's parallel state describe a ``ParallelLayout`` in the running processes."""

from __future__ import annotations

import torch.distributed as dist

from megatron_earl.parallel.layout import ParallelLayout


def initialize_layout(layout: ParallelLayout) -> None:
    """Build Megatron's model-parallel groups for ``layout``. Every rank of the world calls it."""
    from megatron.core import parallel_state

    layout.check_world(dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
    )


def use_layout(layout: ParallelLayout) -> None:
    """Make Megatron's parallel state describe ``layout`` (replacing any previous layout).

    Every rank of the world calls it. (First version: tears down and rebuilds; the cached,
    leak-free switch replaces this body.)
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_layout(layout)
