"""The device-faithful emulation tier: a non-CPU device on a CPU-only machine, where host/device
mixing fails as it does on CUDA and NCCL.

    MEGATRON_EARL_EMULATE_DEVICE=1 python -m pytest tests/emulation

``runtime.initialize`` calls ``install()`` when ``MEGATRON_EARL_EMULATE_DEVICE=1``; the device
policy is then ``emu:LOCAL_RANK`` with separate host groups, as on GPUs. What it is:

* **A device.** PyTorch's PrivateUse1 key, renamed ``emu``, with a Python device guard and hooks
  (``device_count()`` = ``MEGATRON_EARL_EMULATED_DEVICES``, default 8, checked against
  LOCAL_RANK; every process computes on its own ``emu:0``). A tensor on it is an
  ``EmuTensor``: a wrapper subclass whose ``device`` is ``emu:N`` and which holds a CPU tensor.
  Every aten op on it unwraps, runs the CPU kernel and re-wraps, so views alias, autograd,
  parameters, optimizers and ``param.data = ...`` work as on CUDA. Factories with ``device="emu"``
  and ``.to("emu")`` reach a PrivateUse1 fallback that builds the CPU tensor and wraps it.
* **Mixing fails.** An op that gets a device tensor and a host tensor of one or more dimensions
  raises ``HostDeviceMixError`` naming the op, the host tensor's shape and dtype, and the first
  call site in megatron_earl (or megatron.core). As on CUDA, these stay allowed: copies between
  host and device (``.to``, ``copy_``), a 0-dim host tensor (a CPU scalar) as an operand of a
  pointwise op or as a fill value (``masked_fill``, ``fill_``), and host index tensors in
  advanced indexing (``x[idx]``, ``x[idx] = v``); a CPU scalar anywhere else (``torch.stack``,
  ``embedding``, ``index_select``, ``cat``, a matmul) fails, as on CUDA.
* **Collectives check their group's role.** Every process runs gloo underneath, but a group is
  a *device* group (the world, and every ``new_group(backend=None)``: NCCL on GPUs) or a *host*
  group (``new_group(backend="gloo")``). A host tensor on a device group fails (NCCL cannot move
  host memory), and so does a device tensor on a host group (this project keeps metadata on
  gloo host groups). The guard wraps the ``torch.distributed`` collectives, checks, then runs them
  on the CPU tensors the wrappers hold. Object collectives (``all_gather_object`` ...) are allowed
  on both roles, as on NCCL. A collective that reaches an ``EmuTensor`` without the guard raises.

What it cannot see (docs/devices.md): asynchrony (every op is synchronous: a missing stream sync
or a non-blocking copy read too early is invisible), pinned memory (``pin_memory`` needs CUDA, so
the policy does not pin here), device memory (no OOM, no fragmentation; the selector's budget is
its own check), NCCL's own rules beyond placement (communicator init order, the first batched p2p
rule is documented, not enforced), kernels (TE, flash attention, fused ops: the emulated device
runs the CPU kernels), and ``data_ptr()`` / storage access (an ``EmuTensor`` has no storage:
code that needs one raises here but would run on CUDA).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

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
    """A host tensor met a device tensor where CUDA/NCCL would refuse it."""


def device_count() -> int:
    """How many emulated devices this node has (``MEGATRON_EARL_EMULATED_DEVICES``, default 8)."""
    value = os.environ.get(COUNT_ENV, "8")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{COUNT_ENV}={value!r}: expected a positive integer")
    return int(value)


def device(local_rank: int = 0) -> torch.device:
    """This process's emulated device: ``emu:0`` whatever the local rank (torch's Python device
    guard knows one device per process, as a rank with ``CUDA_VISIBLE_DEVICES`` set to its own GPU
    does); ``device_count()`` still bounds the ranks per node (``runtime.initialize``)."""
    return torch.device(NAME, 0)


def is_emulated(tensor: Any) -> bool:
    return isinstance(tensor, EmuTensor)


def _machinery() -> frozenset[str]:
    from megatron_earl.patches import cpu_redirect

    return frozenset({__file__, cpu_redirect.__file__})


def call_site() -> str:
    """Where the current op was called: the innermost frame outside torch and this module, and
    the innermost megatron_earl frame when that is a different one (e.g. inside megatron.core)."""
    machinery = _machinery()
    frames = [
        f
        for f in traceback.extract_stack()
        if f.filename not in machinery and "/torch/" not in f.filename
    ]
    if not frames:
        return "unknown"
    inner = frames[-1]
    where = f"{inner.filename}:{inner.lineno} in {inner.name}"
    ours = [f for f in frames if "megatron_earl" in f.filename]
    if ours and ours[-1] is not inner:
        where += f" (from {ours[-1].filename}:{ours[-1].lineno} in {ours[-1].name})"
    return where


def _describe(tensor: torch.Tensor) -> str:
    text = f"host tensor of shape {tuple(tensor.shape)} ({tensor.dtype})"
    if tensor._base is not None:  # a slice of a buffer (a KV cache, a packed batch): name it
        text += f", a view of a host tensor of shape {tuple(tensor._base.shape)},"
    return text


class EmuTensor(torch.Tensor):
    """A tensor on the emulated device: a wrapper around the CPU tensor that holds its values."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> EmuTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=device(),
            requires_grad=inner.requires_grad,
            # Sizes and strides are asked of the held tensor, so out= ops that resize it (e.g.
            # arange's empty + arange.out) resize the device tensor too.
            dispatch_sizes_strides_policy="sizes",
        )
        wrapper._inner = inner
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

    def new_tensor(self, data: Any, dtype=None, device=None, requires_grad=False) -> torch.Tensor:
        # Built from data in C++ below the fallback (like torch.tensor): host, then copy.
        host = torch.Tensor.new_tensor(torch.empty(0), data, dtype=dtype or self.dtype)
        return host.to(device or self.device).requires_grad_(requires_grad)

    def tolist(self) -> Any:  # a device -> host sync on CUDA; allowed
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


def _flat(args: Any, kwargs: Any) -> list[Any]:
    out: list[Any] = []
    tree_map(out.append, (args, kwargs))
    return out


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
    if name.startswith(("c10d::", "_c10d_functional::")):
        raise HostDeviceMixError(
            f"collective {overload} reached the emulated device outside the collective guard at "
            f"{call_site()}; call it through torch.distributed (the guard wraps those functions)"
        )
    hosts: list[torch.Tensor] = []
    originals: dict[int, EmuTensor] = {}

    def unwrap(value: Any) -> Any:
        if isinstance(value, EmuTensor):
            originals[id(value._inner)] = value
            return value._inner
        if isinstance(value, torch.Tensor):
            hosts.append(value)
        return value

    inner_args = tree_map(unwrap, args)
    inner_kwargs = tree_map(unwrap, kwargs)
    scalars_ok = _takes_cpu_scalars(func, overload)
    mixed = [h for h in hosts if h.dim() > 0 or not scalars_ok]
    if name in _COPY_OPS:
        mixed = []
    elif overload in _INDEX_OPS and isinstance(args[0], EmuTensor):
        # x[idx] / x[idx] = v on a device tensor: host index tensors are moved by CUDA too.
        index_ids = {id(t) for t in args[1] if isinstance(t, torch.Tensor)}
        mixed = [h for h in mixed if id(h) not in index_ids]
    if mixed:
        raise HostDeviceMixError(
            f"{overload} got a {_describe(mixed[0])} together with device tensors on "
            f"{device()}, at {call_site()}. On CUDA this raises 'Expected all tensors to be "
            "on the same device': move it with runtime.to_device at a documented boundary "
            "(docs/devices.md) or create it on runtime.device()"
        )
    to_host = name == "aten::_to_copy" and _targets_host(kwargs)
    inner_kwargs = tree_map(_to_host_device, inner_kwargs)
    result = func(*inner_args, **inner_kwargs)
    if to_host:
        return result
    host_ids = {id(h) for h in hosts}

    def wrap(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, EmuTensor):
            return value
        if id(value) in originals:  # in-place and out= ops return their argument
            return originals[id(value)]
        if id(value) in host_ids:  # copy_ into a host tensor
            return value
        return EmuTensor(value)

    if torch.is_inference_mode_enabled():
        # A wrapper made in inference mode is an inference tensor, which autograd's view
        # tracking then refuses as the view of a normal tensor (CUDA tensors have no such issue):
        # wrappers are normal tensors (the emulation does not check inference-tensor misuse).
        with torch.inference_mode(False):
            return tree_map(wrap, result)
    return tree_map(wrap, result)


def _targets_host(kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device")
    return target is not None and torch.device(target).type == "cpu"


def _factory_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Ops dispatched to the emulated device without an ``EmuTensor`` argument: factories
    (``torch.zeros(..., device="emu")``) and the allocation inside a host -> device copy."""
    result = op(*tree_map(_to_host_device, args), **tree_map(_to_host_device, kwargs))
    return tree_map(
        lambda v: EmuTensor(v) if isinstance(v, torch.Tensor) else v,
        result,
    )


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

    @staticmethod
    def current_device() -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

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
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_single",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
_OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
)


def group_role(group: Any) -> str:
    """``"host"`` for groups made with ``backend="gloo"``, ``"device"`` for the others."""
    if group is None or group is dist.GroupMember.WORLD:
        return "device"
    return (
        "host" if dist.distributed_c10d._get_process_group_name(group) in _HOST_GROUPS else "device"
    )


def _check_placement(fn_name: str, group: Any, tensors: list[torch.Tensor]) -> None:
    role = group_role(group)
    for tensor in tensors:
        on_device = isinstance(tensor, EmuTensor)
        if role == "device" and not on_device:
            raise HostDeviceMixError(
                f"torch.distributed.{fn_name} got a {_describe(tensor)} on a device group "
                f"(NCCL on GPUs cannot move host memory), at {call_site()}: send metadata over "
                "parallel.groups.host_group(...) or move data to runtime.device()"
            )
        if role == "host" and on_device:
            raise HostDeviceMixError(
                f"torch.distributed.{fn_name} got a device tensor of shape {tuple(tensor.shape)} "
                f"on a host (gloo) group, at {call_site()}: device data goes over device groups"
            )


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


def _guard(fn_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if getattr(_STATE, "inside", False):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        if fn_name == "batch_isend_irecv":
            ops = bound.arguments["p2p_op_list"]
            for op in ops:
                _check_placement(fn_name, op.group, [op.tensor])
            for op in ops:
                op.tensor = _inner(op.tensor)
        else:
            tensors = [t for v in bound.arguments.values() for t in _tensors(v)]
            _check_placement(fn_name, bound.arguments.get("group"), tensors)
            for key, value in bound.arguments.items():
                bound.arguments[key] = _inner(value)
        _STATE.inside = True
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            _STATE.inside = False

    return guarded


def _passthrough(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        previous = getattr(_STATE, "inside", False)
        _STATE.inside = True
        try:
            return original(*args, **kwargs)
        finally:
            _STATE.inside = previous

    return call


def _passthrough_named(fn_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    return _passthrough(original)


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
        _rebind_captured(replaced)
        tagging = _tagging_new_group(c10d.new_group)
        c10d.new_group = tagging
        dist.new_group = tagging
        _INSTALLED = True


_LIBRARIES: list[Any] = []
