"""Process start-up: the version guard, Megatron-Core patches (``patches/``), torch.distributed,
seeding.

Every entry point calls ``initialize()`` once per process before touching megatron-core.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_earl import patches
from megatron_earl.compat.version import check_megatron_core


def device() -> torch.device:
    """The device this process computes on: its local CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize(timeout_s: float = 300.0) -> None:
    """Check megatron-core, apply every patch (``patches.apply_all``: the CPU ones only when there
    is no CUDA), and join the process group.

    Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a
    process started without it runs as a world of one. Every process of the job must call it.
    """
    check_megatron_core()
    patches.apply_all()
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def seed(value: int) -> None:
    """Seed the default generators and Megatron's tracker (call after the parallel state exists).

    The tensor-parallel state differs per TP rank (Megatron's rule: seed + 2718 + tp_rank).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(value)
    tensor_parallel.model_parallel_cuda_manual_seed(value)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the default generators and Megatron's tracked RNG states (and seeds) on exit, so
    the run's streams continue as if the body had not run. Local."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved = (tracker.get_states(), set(tracker.seeds_)) if tracker.is_initialized() else None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            if saved is not None:
                tracker.set_states(saved[0])
                tracker.seeds_ = saved[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
