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
    "host_rendezvous",
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

    A world of one with no ``MASTER_PORT`` hosts its rendezvous store on a port the OS gives it
    (``host_rendezvous``): picking a free port and binding it later lets another process take it
    in between.
    """
    check_megatron_core()
    patches.apply_all()
    if dist.is_initialized():
        return
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"collective timeout_s ({timeout_s!r}) must be a finite number > 0")
    timeout = datetime.timedelta(seconds=timeout_s)
    env = launch_env(os.environ, lambda: 0)
    if env["MASTER_PORT"] == "0" and env["WORLD_SIZE"] == "1" and _RENDEZVOUS is None:
        os.environ.update(RANK="0", WORLD_SIZE="1")
        host_rendezvous(1, timeout_s)
        env = launch_env(os.environ)
    elif env["MASTER_PORT"] == "0":
        env["MASTER_PORT"] = str(_free_port())
    os.environ.update(env)
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
    if _RENDEZVOUS is None:
        dist.init_process_group(backend=fixed.device_backend, timeout=timeout)
    else:
        # under the prefix torch's env:// rendezvous gives the default group's keys: the peers
        # this process started join that way
        _RENDEZVOUS.set_timeout(timeout)
        dist.init_process_group(
            backend=fixed.device_backend,
            store=dist.PrefixStore("default_pg", _RENDEZVOUS),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    groups.init_host_world()  # the world's gloo twin for host metadata (device policies only)


_RENDEZVOUS: dist.TCPStore | None = None
"""The store ``host_rendezvous`` bound, which ``initialize`` joins the world through."""


def host_rendezvous(world_size: int, timeout_s: float = 300.0) -> int:
    """Host the world's rendezvous store (this process is its rank 0) on a port the OS picks at
    bind time, set ``MASTER_ADDR``/``MASTER_PORT`` to it and return the port; ``initialize``
    then joins through it. For a process that starts its own peers (``serve --tp-size N``):
    call it before telling them the port, so no other process can take the port in between."""
    global _RENDEZVOUS
    if _RENDEZVOUS is not None:
        raise RuntimeError(f"this process already hosts a rendezvous (port {_RENDEZVOUS.port})")
    _RENDEZVOUS = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_RENDEZVOUS.port))
    return _RENDEZVOUS.port


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
