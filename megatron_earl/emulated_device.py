"""The device-faithful emulation tier: a non-CPU device on a CPU-only machine, where host/device
mixing fails as it does on CUDA and NCCL.

    MEGATRON_EARL_EMULATE_DEVICE=1 python -m pytest tests/emulation

``runtime.initialize`` calls ``install()`` when ``MEGATRON_EARL_EMULATE_DEVICE=1``; the device
policy is then ``emu:LOCAL_RANK`` with separate host groups, as on GPUs. What it is:

* **A device.** PyTorch's PrivateUse1 key, renamed ``emu``, with a Python device guard and hooks
  (``device_count()`` = ``MEGATRON_EARL_EMULATED_DEVICES``, default 8, checked against
  LOCAL_RANK). Rank r computes on ``emu:r`` (``cuda:LOCAL_RANK``). A tensor on it is an
  ``EmuTensor``: a wrapper subclass whose ``device`` is ``emu:N`` and which holds a CPU tensor.
  Every aten op on it unwraps, runs the CPU kernel and re-wraps, so views alias, autograd,
  parameters, optimizers and ``param.data = ...`` work as on CUDA. Factories with ``device="emu"``
  and ``.to("emu:N")`` reach a PrivateUse1 fallback that builds the CPU tensor and wraps it.
* **Mixing fails** (``HostDeviceMixError``, naming the op, the tensor and the first call site in
  megatron_earl or megatron.core): a host tensor of one or more dimensions beside device tensors;
  a 0-dim host tensor (a CPU scalar) outside pointwise ops, fill values and indexing
  (``torch.stack``, ``embedding``, ``index_select``, ``cat``, a matmul); device tensors of two
  indices. As on CUDA, these stay allowed: copies between host and device or two devices (``.to``,
  ``copy_``), CPU scalars in pointwise ops and as fill values (``masked_fill``, ``fill_``), and
  host index tensors in advanced indexing (``x[idx]``, ``x[idx] = v``).
* **Non-blocking copies are pending.** The host tensor a non-blocking device -> host copy returns
  (or writes, ``copy_``) is pending (``emulated_copies``) until the device synchronises
  (``torch.emu.synchronize()``, an ``Event``'s or the stream's ``synchronize()``, or a blocking
  read: ``.item()``, ``.tolist()``, a blocking copy); using its values before raises
  ``UnsyncedReadError``. Only the copies not yet synchronised are tracked.
* **Host syncs are counted** while a ``host_syncs()`` block is open (``emulated_syncs``): every
  read of device values by the host (``.item()``, ``.tolist()``, ``torch.equal``, blocking
  device -> host copies, ``nonzero``-like ops), by kind and call site.
* **Collectives check their group's role.** Every process runs gloo underneath, but a group is
  a *device* group (the world, and every ``new_group(backend=None)``: NCCL on GPUs) or a *host*
  group (``new_group(backend="gloo")``, a ``ProcessGroupGloo`` made directly). A host tensor on a
  device group fails (NCCL cannot move host memory), and so do a device tensor of another index
  than the rank's, a reduce op NCCL lacks (BAND, BOR, BXOR), and a device tensor on a host group
  (this project keeps metadata on gloo host groups). The guard wraps the ``torch.distributed``
  collectives and the collective methods of ``ProcessGroup`` / ``Backend`` objects, checks, then
  runs them on the CPU tensors the wrappers hold. Object collectives (``all_gather_object`` ...)
  are allowed on both roles, as on NCCL. A collective that reaches an ``EmuTensor`` without the
  guard raises.

What it cannot see (docs/devices.md): streams beyond one per device and host -> device copies'
sources changed before they land; pinned memory (``pin_memory`` needs CUDA, so the policy does
not pin here); device memory (no OOM, no fragmentation; the selector's budget is its own check);
NCCL's own rules beyond placement and reduce ops (communicator init order; the first batched p2p
rule is documented, not enforced); kernels (TE, flash attention, fused ops: the emulated device
runs the CPU kernels); ``data_ptr()`` / storage access (an ``EmuTensor`` has no storage: code that
needs one raises here but would run on CUDA); and an unindexed ``.to("emu")`` lands on ``emu:0``
(torch's Python device guard reports index 0 as current), where ``.to("cuda")`` would pick the
current GPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from megatron_earl.emulated_copies import (
    SYNC_OPS,
    Event,
    Stream,
    call_site,
    land,
    mark_pending,
    pending_copies,
)
from megatron_earl.emulated_syncs import OP_KINDS, HostSyncs, SyncKind, counting, host_syncs, record

__all__ = ["HostSyncs", "SyncKind", "host_syncs"]  # the sync counter (emulated_syncs)

NAME = "emu"
COUNT_ENV = "MEGATRON_EARL_EMULATED_DEVICES"

_COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::lift_fresh"})
# Advanced indexing accepts host index tensors on CUDA (they are moved to the device).
_INDEX_OPS = frozenset({"aten::index.Tensor", "aten::index_put_", "aten::_index_put_impl_"})
"""Overloads whose host index tensors (second argument) CUDA accepts for a device ``self``."""
_SCALAR_VALUE_OPS = frozenset(
    {"aten::masked_fill.Tensor", "aten::masked_fill_.Tensor", "aten::fill_.Tensor",
     "aten::fill.Tensor"}
)  # fmt: skip
"""Non-pointwise overloads that take a CPU scalar (a 0-dim host tensor) as their fill value on
CUDA. Elsewhere CUDA accepts one only in pointwise (TensorIterator) ops (``_takes_cpu_scalars``):
``torch.stack``, ``embedding``, ``index_select``, ``cat``, matmuls... refuse it."""
_INSTALLED = False
_LOCK = threading.Lock()
_STATE = threading.local()


class HostDeviceMixError(RuntimeError):
    """A host tensor met a device tensor, or tensors of two device indices met, where CUDA/NCCL
    would refuse it."""


def device_count() -> int:
    """How many emulated devices this node has (``MEGATRON_EARL_EMULATED_DEVICES``, default 8)."""
    value = os.environ.get(COUNT_ENV, "8")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{COUNT_ENV}={value!r}: expected a positive integer")
    return int(value)


def current_index() -> int:
    """This process's device index: its LOCAL_RANK (on GPUs ``runtime.initialize`` makes
    ``cuda:LOCAL_RANK`` current with ``torch.cuda.set_device``)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def device(local_rank: int | None = None) -> torch.device:
    """``emu:local_rank`` (default: this process's, ``current_index()``). Rank r of a node
    computes on ``emu:r`` as on ``cuda:r``; ``device_count()`` bounds the ranks per node
    (``runtime.initialize``)."""
    return torch.device(NAME, current_index() if local_rank is None else local_rank)


def is_emulated(tensor: Any) -> bool:
    return isinstance(tensor, EmuTensor)


def _describe(tensor: torch.Tensor) -> str:
    text = f"host tensor of shape {tuple(tensor.shape)} ({tensor.dtype})"
    if tensor._base is not None:  # a slice of a buffer (a KV cache, a packed batch): name it
        text += f", a view of a host tensor of shape {tuple(tensor._base.shape)},"
    return text


class EmuTensor(torch.Tensor):
    """A tensor on the emulated device: a wrapper around the CPU tensor that holds its values."""

    _inner: torch.Tensor
    _index: int
    """The device index (``emu:_index``), kept as an int: the mixing check reads it per op."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, index: int) -> EmuTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=torch.device(NAME, index),
            requires_grad=inner.requires_grad,
            # Sizes and strides are asked of the held tensor, so out= ops that resize it (e.g.
            # arange's empty + arange.out) resize the device tensor too.
            dispatch_sizes_strides_policy="sizes",
        )
        wrapper._inner = inner
        wrapper._index = index
        return wrapper

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # ``t.data = other`` swaps the storage under ``t`` (Megatron's make_viewless_tensor, DDP's
        # parameter buffers): the held CPU tensor must follow.
        if not isinstance(value, EmuTensor):
            raise HostDeviceMixError(
                f"assigning a {_describe(value)} to .data of a device tensor at {call_site()}: "
                "CUDA allows moving a tensor this way, the emulated device does not"
            )
        torch.Tensor.data.__set__(self, value)
        self._inner = value._inner
        self._index = value._index

    def new_tensor(self, data: Any, dtype=None, device=None, requires_grad=False) -> torch.Tensor:
        # Built from data in C++ below the fallback (like torch.tensor): host, then copy.
        host = torch.Tensor.new_tensor(torch.empty(0), data, dtype=dtype or self.dtype)
        return host.to(device or self.device).requires_grad_(requires_grad)

    def tolist(self) -> Any:  # a device -> host sync on CUDA; allowed
        if counting():
            record(SyncKind.TOLIST, self.numel() * self.element_size())
        land()
        return self._inner.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy (as on CUDA), at "
            f"{call_site()}: use Tensor.cpu() to copy the tensor to host memory first"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"EmuTensor({self._inner!r}, device='{self.device}')"

    def __reduce_ex__(self, protocol: int) -> Any:
        raise HostDeviceMixError(
            f"pickling a device tensor of shape {tuple(self.shape)} at {call_site()}: move it to "
            "the host first (runtime.to_host) at a documented boundary"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _takes_cpu_scalars(func: Any, overload: str) -> bool:
    """Whether CUDA takes a 0-dim host tensor beside device tensors in this op: pointwise ops
    (torch's ``pointwise`` tag: TensorIterator's CPU-scalar rule), the fill values of
    ``_SCALAR_VALUE_OPS``, the foreach ops (their scalar lists) and indexing (``_INDEX_OPS``)."""
    return (
        torch.Tag.pointwise in func.tags
        or overload in _SCALAR_VALUE_OPS
        or overload in _INDEX_OPS
        or overload.startswith("aten::_foreach_")
    )


def _to_host_device(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == NAME:
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == NAME:
        return torch.device("cpu")
    return value


_METADATA_OPS = {
    "aten::sym_size": lambda t: t.size(),
    "aten::sym_stride": lambda t: t.stride(),
    "aten::sym_numel": lambda t: t.numel(),
    "aten::dim": lambda t: t.dim(),
    "aten::sym_storage_offset": lambda t: t.storage_offset(),
}


def _run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    name = func._schema.name
    if name in _METADATA_OPS:
        return _METADATA_OPS[name](args[0]._inner)
    overload = f"{name}.{func._overloadname}" if func._overloadname != "default" else name
    if counting():
        _count_sync(name, func, args, kwargs)
    if name.startswith(("c10d::", "_c10d_functional::")):
        raise HostDeviceMixError(
            f"collective {overload} reached the emulated device outside the collective guard at "
            f"{call_site()}; call it through torch.distributed (the guard wraps those functions)"
        )
    hosts: list[torch.Tensor] = []
    devices: list[EmuTensor] = []
    originals: dict[int, EmuTensor] = {}

    def unwrap(value: Any) -> Any:
        if isinstance(value, EmuTensor):
            originals[id(value._inner)] = value
            devices.append(value)
            return value._inner
        if isinstance(value, torch.Tensor):
            hosts.append(value)
        return value

    inner_args = tree_map(unwrap, args)
    inner_kwargs = tree_map(unwrap, kwargs)
    pending = None
    if name in _COPY_OPS:  # host <-> device and device <-> device copies are allowed
        pending = _sync_copy(name, args, kwargs, hosts)
    elif hosts or len(devices) > 1:
        _check_mixing(func, overload, args, hosts, devices)
    if name in SYNC_OPS and pending_copies():
        land()
    target = kwargs.get("device")
    index = devices[0]._index if devices else current_index()
    if target is not None and torch.device(target).type == NAME:
        index = _index_of(target)
    to_host = name == "aten::_to_copy" and _targets_host(kwargs)
    inner_kwargs = tree_map(_to_host_device, inner_kwargs)
    result = func(*inner_args, **inner_kwargs)
    if pending is not None:
        mark_pending(pending)
    if to_host:
        if kwargs.get("non_blocking"):
            mark_pending(result)
        return result
    host_ids = {id(h) for h in hosts}

    def wrap(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, EmuTensor):
            return value
        if id(value) in originals:  # in-place and out= ops return their argument
            return originals[id(value)]
        if id(value) in host_ids:  # copy_ into a host tensor
            return value
        return EmuTensor(value, index)

    if torch.is_inference_mode_enabled():
        # A wrapper made in inference mode is an inference tensor, which autograd's view
        # tracking then refuses as the view of a normal tensor (CUDA tensors have no such issue):
        # wrappers are normal tensors (the emulation does not check inference-tensor misuse).
        with torch.inference_mode(False):
            return tree_map(wrap, result)
    return tree_map(wrap, result)


def _count_sync(name: str, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """Report the op to an open ``host_syncs()`` block if it makes the host wait on CUDA
    (``emulated_syncs``); ``args`` hold at least one device tensor."""
    kind, nbytes = OP_KINDS.get(name), 0
    if name == "aten::_to_copy" and _targets_host(kwargs) and not kwargs.get("non_blocking"):
        kind, nbytes = SyncKind.TO_HOST, args[0].numel() * args[0].element_size()
    elif name == "aten::copy_" and not ((len(args) > 2 and args[2]) or kwargs.get("non_blocking")):
        dst, src = args[0], args[1]
        if isinstance(src, EmuTensor) and not isinstance(dst, EmuTensor):
            kind, nbytes = SyncKind.TO_HOST, src.numel() * src.element_size()
        elif not isinstance(src, EmuTensor) and isinstance(src, torch.Tensor) and src.dim() > 0:
            kind = SyncKind.TO_DEVICE  # a 0-dim host source is a CPU scalar, not a copy
    elif name in ("aten::index", "aten::index_put_", "aten::_index_put_impl_"):
        masks = [
            t for t in args[1]
            if isinstance(t, EmuTensor) and t.dtype in (torch.bool, torch.uint8)
        ]  # fmt: skip
        # x[mask] = scalar runs as masked_fill_ on CUDA (canDispatchToMaskedFill): no sync
        fill = name != "aten::index" and len(args[1]) == 1 and args[2].numel() == 1
        kind = SyncKind.NONZERO if masks and not fill else None
    elif name == "aten::repeat_interleave" and func._overloadname == "Tensor":
        output_size = args[1] if len(args) > 1 else kwargs.get("output_size")
        kind = SyncKind.REPEAT_INTERLEAVE if output_size is None else None
    if kind is not None:
        record(kind, nbytes)


def _check_mixing(
    func: Any, overload: str, args: Any, hosts: list[torch.Tensor], devices: list[EmuTensor]
) -> None:
    """Refuse host tensors CUDA refuses beside device tensors, and device tensors of two
    indices (CUDA's "Expected all tensors to be on the same device")."""
    scalars_ok = _takes_cpu_scalars(func, overload)
    mixed = [h for h in hosts if h.dim() > 0 or not scalars_ok]
    if overload in _INDEX_OPS and isinstance(args[0], EmuTensor):
        # x[idx] / x[idx] = v on a device tensor: CUDA moves index tensors to x's device.
        index_ids = {id(t) for t in args[1] if isinstance(t, torch.Tensor)}
        mixed = [h for h in mixed if id(h) not in index_ids]
        devices = [d for d in devices if id(d) not in index_ids]
    if mixed:
        raise HostDeviceMixError(
            f"{overload} got a {_describe(mixed[0])} together with device tensors on "
            f"{devices[0].device}, at {call_site()}. On CUDA this raises 'Expected all tensors "
            "to be on the same device': move it with runtime.to_device at a documented boundary "
            "(docs/devices.md) or create it on runtime.device()"
        )
    other = next((d for d in devices if d._index != devices[0]._index), None)
    if other is not None:
        raise HostDeviceMixError(
            f"{overload} got tensors on {devices[0].device} and {other.device}, at "
            f"{call_site()}. On CUDA this raises 'Expected all tensors to be on the same device, "
            "but found at least two devices': a rank computes on runtime.device() only"
        )


def _sync_copy(
    name: str, args: Any, kwargs: dict[str, Any], hosts: list[torch.Tensor]
) -> torch.Tensor | None:
    """A blocking device -> host copy waits for the stream: earlier non-blocking copies land.
    Returns the host tensor a non-blocking ``copy_`` leaves pending (``_to_copy``'s result is
    marked by ``_run``)."""
    if name == "aten::copy_" and hosts and hosts[0] is args[0] and isinstance(args[1], EmuTensor):
        if (len(args) > 2 and args[2]) or kwargs.get("non_blocking", False):
            return args[0]
    elif not (name == "aten::_to_copy" and _targets_host(kwargs)) or kwargs.get("non_blocking"):
        return None
    if pending_copies():
        land()
    return None


def _index_of(target: Any) -> int:
    index = torch.device(target).index
    return current_index() if index is None else index


def _targets_host(kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device")
    return target is not None and torch.device(target).type == "cpu"


def _factory_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Ops dispatched to the emulated device without an ``EmuTensor`` argument: factories
    (``torch.zeros(..., device="emu:1")``) and the allocation inside a host -> device copy."""
    target = kwargs.get("device")
    index = _index_of(target) if target is not None else current_index()
    result = op(*tree_map(_to_host_device, args), **tree_map(_to_host_device, kwargs))
    return tree_map(lambda v: EmuTensor(v, index) if isinstance(v, torch.Tensor) else v, result)


def _host_then_move(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.tensor(data, device="emu")`` and ``torch.tensor([device scalars])`` reach the
    device in C++ below the Python fallback (an internal assert). Build on the host from the
    host values and copy, which is what CUDA does too (and a device target is kept)."""

    @functools.wraps(original)
    def create(data: Any, *args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("device")
        to_device = target is not None and torch.device(target).type == NAME
        if not to_device and not _holds_emulated(data):
            return original(data, *args, **kwargs)
        if isinstance(data, EmuTensor) and target is None:
            return original(data, *args, **kwargs)
        if counting() and not isinstance(data, EmuTensor):  # .item() of each device element
            for _ in range(_num_emulated(data)):
                record(SyncKind.ITEM)
        kwargs["device"] = "cpu"
        requires_grad = kwargs.pop("requires_grad", False)
        host = original(_inner(data), *args, **kwargs)
        moved = host.to(target) if to_device else host
        return moved.requires_grad_(requires_grad) if requires_grad else moved

    return create


def _holds_emulated(data: Any) -> bool:
    if isinstance(data, EmuTensor):
        return True
    return isinstance(data, (list, tuple)) and any(_holds_emulated(x) for x in data)


def _num_emulated(data: Any) -> int:
    if isinstance(data, EmuTensor):
        return 1
    return sum(_num_emulated(x) for x in data) if isinstance(data, (list, tuple)) else 0


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_index: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self) -> torch._C._autograd.DeviceType:
        return torch._C._autograd.DeviceType.PrivateUse1


class _Module:
    """``torch.emu``: the device module torch looks up for the renamed backend."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return device_count()

    Event = Event

    @staticmethod
    def current_device() -> int:
        return current_index()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Every non-blocking copy has landed (``torch.cuda.synchronize``)."""
        if counting():
            record(SyncKind.SYNCHRONIZE)
        land()

    @staticmethod
    def current_stream(device: Any = None) -> Stream:
        return Stream()

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


# ---- collectives ---------------------------------------------------------------------------------

_HOST_GROUPS: set[str] = set()
_GUARDED = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_single",
    "all_gather_coalesced", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
_OBJECT_COLLECTIVES = (
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "barrier", "monitored_barrier",
)  # fmt: skip
_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
    "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "alltoall", "alltoall_base", "all_to_all_single", "broadcast", "send", "recv",
    "recv_anysource",
)  # fmt: skip
"""Collectives of ``ProcessGroup`` and ``Backend`` objects (``group.allreduce([t])``, SGLang's
weight-update group); the ``torch.distributed`` functions call them inside their own guard."""
_NCCL_LACKS = (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)
"""Reduce ops NCCL has not (ProcessGroupNCCL raises "Cannot use ReduceOp.BAND with NCCL")."""


def group_role(group: Any) -> str:
    """``"host"`` for groups made with ``backend="gloo"`` and gloo backends used directly
    (``ProcessGroupGloo(store, ...)``), ``"device"`` for the others."""
    if group is None or group is dist.GroupMember.WORLD:
        return "device"
    if isinstance(group, dist.ProcessGroupGloo):
        return "host"
    return (
        "host" if dist.distributed_c10d._get_process_group_name(group) in _HOST_GROUPS else "device"
    )


def _check_placement(where: str, role: str, tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        on_device = isinstance(tensor, EmuTensor)
        if role == "device" and not on_device:
            raise HostDeviceMixError(
                f"{where} got a {_describe(tensor)} on a device group "
                f"(NCCL on GPUs cannot move host memory), at {call_site()}: send metadata over "
                "parallel.groups.host_group(...) or move data to runtime.device()"
            )
        if role == "device" and tensor._index != current_index():
            raise HostDeviceMixError(
                f"{where} got a device tensor of shape {tuple(tensor.shape)} on {tensor.device}, "
                f"but this rank's device group communicates on {device()} (an NCCL "
                f"communicator moves its own device's memory), at {call_site()}"
            )
        if role == "host" and on_device:
            raise HostDeviceMixError(
                f"{where} got a device tensor of shape {tuple(tensor.shape)} "
                f"on a host (gloo) group, at {call_site()}: device data goes over device groups"
            )


def _check_reduce_op(where: str, role: str, op: Any) -> None:
    # op == o, not o == op: a RedOpType compares False with a ReduceOp (an options' reduceOp)
    lacking = [o for o in _NCCL_LACKS if op is not None and op == o]
    if role == "device" and lacking:
        raise ValueError(
            f"Cannot use ReduceOp.{lacking[0].name} with NCCL ({where} on a device group, at "
            f"{call_site()}): reduce with SUM/MAX/MIN, or over a host group"
        )


def _reduce_op(values: list[Any]) -> Any:
    """The reduce op among a ``ProcessGroup`` method's arguments (an op or an options object)."""
    for value in values:
        if isinstance(value, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            return value
        if hasattr(value, "reduceOp"):
            return value.reduceOp
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found.extend(_tensors(item))
    return found


def _inner(value: Any) -> Any:
    if isinstance(value, EmuTensor):
        return value._inner
    if isinstance(value, list):
        return [_inner(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_inner(v) for v in value)
    return value


def _inside(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``original`` run on checked arguments: the collectives it calls pass unchecked."""
    previous = getattr(_STATE, "inside", False)
    _STATE.inside = True
    try:
        return original(*args, **kwargs)
    finally:
        _STATE.inside = previous


def _guard(fn_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    where = f"torch.distributed.{fn_name}"

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if getattr(_STATE, "inside", False):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        if fn_name == "batch_isend_irecv":
            ops = bound.arguments["p2p_op_list"]
            for op in ops:
                _check_placement(where, group_role(op.group), [op.tensor])
            for op in ops:
                op.tensor = _inner(op.tensor)
        else:
            tensors = [t for v in bound.arguments.values() for t in _tensors(v)]
            role = group_role(bound.arguments.get("group"))
            _check_placement(where, role, tensors)
            _check_reduce_op(where, role, bound.arguments.get("op"))
            for key, value in bound.arguments.items():
                bound.arguments[key] = _inner(value)
        return _inside(original, *bound.args, **bound.kwargs)

    return guarded


def _guard_method(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(group: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_STATE, "inside", False):
            return original(group, *args, **kwargs)
        where = f"{type(group).__name__}.{method}"
        role = group_role(group)
        values = [*args, *kwargs.values()]
        _check_placement(where, role, _tensors(values))
        _check_reduce_op(where, role, _reduce_op(values))
        inner_kwargs = {k: _inner(v) for k, v in kwargs.items()}
        return _inside(original, group, *_inner(args), **inner_kwargs)

    return guarded


def _coalescing(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.distributed._coalescing_manager`` (Megatron's DDP grad sync): the collectives in
    its body are checked (and unwrapped) one by one; on exit it runs them as one coalesced
    ``group.allreduce_coalesced(...)`` on those tensors, which passes unchecked."""

    @contextlib.contextmanager
    @functools.wraps(original)
    def manager(*args: Any, **kwargs: Any) -> Any:
        inner = original(*args, **kwargs)
        value = inner.__enter__()
        try:
            yield value
        except BaseException:
            if not inner.__exit__(*sys.exc_info()):
                raise
        else:
            _inside(inner.__exit__, None, None, None)

    return manager


def _passthrough_named(fn_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    return functools.wraps(original)(functools.partial(_inside, original))


def _rebind_captured(replaced: dict[int, Callable[..., Any]]) -> None:
    """Modules imported before ``install`` may hold a collective under their own name (Megatron's
    ``mappings.dist_all_gather_func = torch.distributed.all_gather_into_tensor``): point every
    such module global at the guarded function."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or module is dist or module is dist.distributed_c10d:
            continue
        for name, value in list(names.items()):
            if callable(value) and id(value) in replaced:
                names[name] = replaced[id(value)]


def _tagging_new_group(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        backend = inspect.signature(original).bind(*args, **kwargs).arguments.get("backend")
        group = original(*args, **kwargs)
        if backend is not None and str(backend).lower() == "gloo" and _is_group(group):
            _HOST_GROUPS.add(dist.distributed_c10d._get_process_group_name(group))
        return group

    return new_group


def _is_group(group: Any) -> bool:
    return group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER


def install() -> None:
    """Make ``emu`` a device, route its ops to CPU kernels with the mixing check, and guard the
    collectives. Idempotent; process-wide; call before any process group exists."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        torch.utils.rename_privateuse1_backend(NAME)
        torch.utils.generate_methods_for_privateuse1_backend()
        torch._register_device_module(NAME, _Module())
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
        torch._C._acc.register_python_privateuseone_device_guard(_Guard())
        library = torch.library.Library("_", "IMPL")
        library.fallback(_factory_fallback, "PrivateUse1")
        _LIBRARIES.append(library)
        for fn_name in ("tensor", "as_tensor"):
            setattr(torch, fn_name, _host_then_move(getattr(torch, fn_name)))
        c10d = dist.distributed_c10d
        replaced: dict[int, Callable[..., Any]] = {}
        for fn_name in _GUARDED + _OBJECT_COLLECTIVES:
            if not hasattr(c10d, fn_name):
                continue
            original = getattr(c10d, fn_name)
            wrapped = (_guard if fn_name in _GUARDED else _passthrough_named)(fn_name, original)
            replaced[id(original)] = wrapped
            replaced[id(getattr(dist, fn_name, original))] = wrapped
            setattr(c10d, fn_name, wrapped)
            setattr(dist, fn_name, wrapped)
        coalescing = _coalescing(c10d._coalescing_manager)
        replaced[id(c10d._coalescing_manager)] = coalescing
        c10d._coalescing_manager = dist._coalescing_manager = coalescing
        _rebind_captured(replaced)
        for cls in (dist.ProcessGroup, torch._C._distributed_c10d.Backend):
            for method in _GROUP_METHODS:
                if method in cls.__dict__:
                    setattr(cls, method, _guard_method(method, cls.__dict__[method]))
        # The autograd engine runs device backward passes on one thread per device index of the
        # device guard, and torch's Python guard knows one index: run them on the calling
        # thread, as for CPU tensors, so that emu:1 ... emu:7 can differentiate.
        torch._C._set_multithreading_enabled(False)
        tagging = _tagging_new_group(c10d.new_group)
        c10d.new_group = tagging
        dist.new_group = tagging
        _INSTALLED = True


_LIBRARIES: list[Any] = []
