"""Process start-up: the version guard, Megatron-Core patches (``patches/``), the device policy,
torch.distributed, seeding.

Every entry point calls ``initialize()`` once per process before touching megatron-core.

The device policy (``policy()``, ``device()``, ``to_device`` / ``to_host``, ``collective_timeout``
...) lives in ``megatron_earl.device_policy`` and is re-exported here: ``initialize`` fixes it,
and ``parallel.groups`` reads it there without importing this module.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_earl import device_policy, patches
from megatron_earl.compat.launch_env import launch_env
from megatron_earl.compat.version import check_megatron_core
from megatron_earl.device_policy import (
    EMULATE_ENV,
    DevicePolicy,
    check_device_available,
    collective_timeout,
    describe_policy,
    device,
    emulating,
    module_to_device,
    policy,
    to_device,
    to_host,
)
from megatron_earl.parallel import groups

__all__ = [
    "EMULATE_ENV",
    "DevicePolicy",
    "check_device_available",
    "collective_timeout",
    "describe_policy",
    "device",
    "emulating",
    "initialize",
    "module_to_device",
    "policy",
    "preserved_rng",
    "seed",
    "to_device",
    "to_host",
]


def initialize(timeout_s: float = 300.0) -> None:
    """Check megatron-core, apply every patch (``patches.apply_all``: the CPU ones only when there
    is no CUDA), and join the process group (on a device policy also the host world group:
    ``parallel.groups.init_host_world``). ``timeout_s`` is the collective timeout of the world
    and of every group created later (``collective_timeout``; a run's
    ``runtime.collective_timeout_s``).

    Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or
    srun's (one task per rank: ``compat.launch_env``); a process started without either runs as
    a world of one, and a task of a multi-task srun job that cannot tell its rank is refused.
    Every process of the job must call it.
    """
    check_megatron_core()
    patches.apply_all()
    if dist.is_initialized():
        return
    os.environ.update(launch_env(os.environ, _free_port))
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"collective timeout_s ({timeout_s!r}) must be a finite number > 0")
    timeout = datetime.timedelta(seconds=timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if emulating():
        from megatron_earl import emulated_device

        emulated_device.install()
        check_device_available(local_rank, emulated_device.device_count(), "emulated")
    elif torch.cuda.is_available():
        check_device_available(local_rank, torch.cuda.device_count(), "CUDA")
        torch.cuda.set_device(local_rank)
    fixed = device_policy.fix(timeout)
    if fixed.emulated:
        from megatron_earl.patches import cpu_redirect

        cpu_redirect.set_target(fixed.device)
    dist.init_process_group(backend=fixed.device_backend, timeout=timeout)
    groups.init_host_world()  # the world's gloo twin for host metadata (device policies only)


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
