"""The device policy: the one answer to "where does this tensor live" -- the compute device
(``cuda:LOCAL_RANK`` on GPUs, the emulated device under ``MEGATRON_EARL_EMULATE_DEVICE=1``, the
CPU otherwise), the backend of the groups that move device tensors (NCCL on GPUs) and of the
groups that move host metadata (gloo) -- and the collective timeout of every process group.

Both are fixed once per process by ``runtime.initialize`` (``fix``); before that, ``policy()``
reads the machine and the timeout is the default. Data crosses between host and device only
through ``to_device`` / ``to_host``, at the boundaries listed in docs/devices.md. Everything here
is re-exported by ``megatron_earl.runtime``; it lives in its own module so that
``parallel.groups``, which ``runtime.initialize`` calls, can read it without importing
``runtime``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

EMULATE_ENV = "MEGATRON_EARL_EMULATE_DEVICE"
"""Set to 1 to compute on the emulated device (``megatron_earl.emulated_device``)."""


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
    """This process's device policy (fixed by ``runtime.initialize``; before it, read from the
    machine)."""
    if _POLICY is not None:
        return _POLICY
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if emulating():
        from megatron_earl import emulated_device

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
    """The timeout of every process group of this process (``runtime.initialize(timeout_s)``): the
    world's, and every group ``parallel.groups`` creates (Megatron's included)."""
    return _COLLECTIVE_TIMEOUT


def fix(timeout: datetime.timedelta) -> DevicePolicy:
    """Fix this process's policy (as ``policy()`` reads it now) and its collective timeout;
    ``runtime.initialize`` calls it once, after selecting the device and before joining the
    process group."""
    global _POLICY, _COLLECTIVE_TIMEOUT
    _COLLECTIVE_TIMEOUT = timeout
    _POLICY = policy()
    return _POLICY
