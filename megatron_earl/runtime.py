"""Process start-up: the version guard, Megatron-Core patches (``patches/``), the device policy,
torch.distributed, seeding.

Every entry point calls ``initialize()`` once per process before touching megatron-core.

The device policy (``policy()``) is the one answer to "where does this tensor live": the compute
device (``cuda:LOCAL_RANK`` on GPUs, the emulated device under ``MEGATRON_EARL_EMULATE_DEVICE=1``,
the CPU otherwise), the backend of the groups that move device tensors (NCCL on GPUs) and of the
groups that move host metadata (gloo). Data crosses between host and device only through
``to_device`` / ``to_host``, at the boundaries listed in docs/devices.md.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_earl import patches
from megatron_earl.compat.version import check_megatron_core

EMULATE_ENV = "MEGATRON_EARL_EMULATE_DEVICE"
"""Set to 1 to compute on the emulated device (``megatron_earl.testing.emulated_device``)."""


@dataclass(frozen=True)
class DevicePolicy:
    """Where this process computes and which backends move its tensors."""

    device: torch.device
    """The compute device: model, loss, dispatch, reshard and engine tensors live here."""
    device_backend: str
    """Backend of the groups that move device tensors ("nccl" on GPUs, else "gloo")."""
    host_backend: str = "gloo"
    """Backend of the groups that move host metadata (lengths, ids, plans, flags)."""
    emulated: bool = False
    """True under the device-faithful emulation tier (gloo underneath, device groups tagged)."""

    @property
    def separate_host_groups(self) -> bool:
        """Whether host metadata needs its own groups beside the device groups (any non-CPU
        device: NCCL cannot move host tensors)."""
        return self.device.type != "cpu"

    @property
    def pin_memory(self) -> bool:
        """Whether host staging buffers are pinned (CUDA only)."""
        return self.device.type == "cuda"


_POLICY: DevicePolicy | None = None
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300.0)


def emulating() -> bool:
    """Whether this process runs on the emulated device (``MEGATRON_EARL_EMULATE_DEVICE=1``)."""
    return os.environ.get(EMULATE_ENV, "0") == "1"


def policy() -> DevicePolicy:
    """This process's device policy (fixed by ``initialize``; before it, read from the machine)."""
    if _POLICY is not None:
        return _POLICY
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if emulating():
        from megatron_earl.testing import emulated_device

        emulated_device.install()  # idempotent: the whole process emulates
        return DevicePolicy(emulated_device.device(local_rank), "gloo", emulated=True)
    if torch.cuda.is_available():
        return DevicePolicy(torch.device("cuda", local_rank), "nccl")
    return DevicePolicy(torch.device("cpu"), "gloo")


def describe_policy() -> str:
    """One line for logs: where this process computes and which backends move its tensors."""
    p = policy()
    device_groups = f"{p.device_backend} (tagged as NCCL)" if p.emulated else p.device_backend
    kind = "emulated device" if p.emulated else p.device.type
    return f"{p.device} ({kind}); device groups {device_groups}, host groups {p.host_backend}" + (
        "" if p.separate_host_groups else " (shared)"
    )


def device() -> torch.device:
    """The device this process computes on (``policy().device``)."""
    return policy().device


def to_device(tensor: torch.Tensor) -> torch.Tensor:
    """Host -> device at a documented boundary (docs/devices.md): pinned, non-blocking on CUDA.
    A tensor already on the compute device is returned as is."""
    target = device()
    if tensor.device == target:
        return tensor
    if policy().pin_memory and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(target, non_blocking=policy().pin_memory)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Device -> host at a documented boundary (docs/devices.md). Synchronous: the caller reads
    the values next (tokens to the environment, checkpoint I/O)."""
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")


def module_to_device(module: torch.nn.Module) -> torch.nn.Module:
    """Move every parameter and buffer of ``module`` that is not on the compute device there,
    keeping Megatron's attributes on the parameters (``tensor_model_parallel``, ``shared`` ...).

    Megatron builds most weights in place but some modules on the host (``torch.nn.RMSNorm`` of
    the local spec); Megatron's own trainer calls ``.cuda()`` after building, and so does this.
    On CUDA ``Module.cuda`` keeps the parameter objects; elsewhere (the emulated device) a moved
    parameter is a new object that gets the old one's attributes. Tied parameters stay tied.
    """
    target = device()
    if target.type == "cuda":
        return module.cuda(target)
    moved: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is None or param.device == target:
                continue
            if id(param) not in moved:
                new = torch.nn.Parameter(param.data.to(target), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                moved[id(param)] = new
            sub._parameters[name] = moved[id(param)]
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != target:
                sub._buffers[name] = buffer.to(target)
    return module


def check_device_available(local_rank: int, count: int, kind: str) -> None:
    """Refuse, before any process group exists, a rank whose local device does not exist."""
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} needs {kind} device {local_rank}, but this node has {count} "
            f"{kind} device(s) (valid LOCAL_RANK: 0..{count - 1}); start at most {count} "
            "processes per node (--nproc / --ntasks-per-node)"
        )


def collective_timeout() -> datetime.timedelta:
    """The timeout of every process group of this process (``initialize(timeout_s)``): the
    world's, and every group ``parallel.groups`` creates (Megatron's included)."""
    return _COLLECTIVE_TIMEOUT


def initialize(timeout_s: float = 300.0) -> None:
    """Check megatron-core, apply every patch (``patches.apply_all``: the CPU ones only when there
    is no CUDA), and join the process group (on a device policy also the host world group:
    ``parallel.groups.init_host_world``). ``timeout_s`` is the collective timeout of the world
    and of every group created later (``collective_timeout``; a run's
    ``runtime.collective_timeout_s``).

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
    global _POLICY, _COLLECTIVE_TIMEOUT
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"collective timeout_s ({timeout_s!r}) must be a finite number > 0")
    _COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if emulating():
        from megatron_earl.testing import emulated_device

        emulated_device.install()
        check_device_available(local_rank, emulated_device.device_count(), "emulated")
    elif torch.cuda.is_available():
        check_device_available(local_rank, torch.cuda.device_count(), "CUDA")
        torch.cuda.set_device(local_rank)
    _POLICY = policy()
    if _POLICY.emulated:
        from megatron_earl.patches import cpu_redirect

        cpu_redirect.set_target(_POLICY.device)
    dist.init_process_group(backend=_POLICY.device_backend, timeout=_COLLECTIVE_TIMEOUT)
    from megatron_earl.parallel import groups

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
