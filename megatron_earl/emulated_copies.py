"""Non-blocking device -> host copies of the emulation tier (``emulated_device``): the host tensor
such a copy returns or writes is *pending* (class ``PendingHost``) until the emulated device
synchronises, and using its values before raises ``UnsyncedReadError``, as reading it on CUDA
could give values that have not landed. Also where an op was called from (``call_site``), for
every error of the tier. Imports nothing of ``emulated_device``, which uses it.
"""

from __future__ import annotations

import os
import traceback
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map


class UnsyncedReadError(RuntimeError):
    """A host tensor that a non-blocking device -> host copy writes was used before the device
    synchronised (on CUDA its values may not have landed)."""


def _machinery() -> frozenset[str]:
    from megatron_earl.patches import cpu_redirect

    here = os.path.dirname(__file__)
    return frozenset({__file__, os.path.join(here, "emulated_device.py"), cpu_redirect.__file__})


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


def flat(args: Any, kwargs: Any) -> list[Any]:
    out: list[Any] = []
    tree_map(out.append, (args, kwargs))
    return out


SYNC_OPS = frozenset(
    {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::nonzero",
     "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive"}
)  # fmt: skip
"""Ops that read device values on the host (``.item()``, ``torch.equal``) or size their output
by them: on CUDA they wait for the stream, so earlier non-blocking copies have landed after."""
_PENDING: dict[int, tuple[int, weakref.ref, type]] = {}
"""id(host tensor) -> (copy number, the tensor, its class before the copy): the host tensors
non-blocking device -> host copies still write. Empty but for the copies not yet synchronised:
the bookkeeping costs nothing elsewhere."""
_COPIES = [0]
"""Non-blocking device -> host copies issued so far (an ``Event`` records the count)."""
_TENSOR_METADATA = frozenset(
    {"shape", "dtype", "device", "size", "dim", "ndim", "numel", "nelement", "__len__", "stride",
     "layout", "is_pinned", "is_contiguous", "element_size", "requires_grad", "__hash__", "is_cpu",
     "is_cuda", "storage_offset"}
)  # fmt: skip
"""What of a pending host tensor may be used before it lands: its metadata, not its values."""


class PendingHost(torch.Tensor):
    """The class of a host tensor while a non-blocking device -> host copy writes it: any use but
    its metadata raises ``UnsyncedReadError``; ``_land`` gives it its class back."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property (t.shape): named by its descriptor
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        # metadata, or a later copy into it from the device (ordered on the device's stream)
        later_copy = name == "copy_" and args[1].device.type not in ("cpu", "meta")
        if name in _TENSOR_METADATA or later_copy:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        pending = next(t for t in flat(args, kwargs) if isinstance(t, PendingHost))
        raise UnsyncedReadError(
            f"a host tensor of shape {tuple(pending.shape)} ({pending.dtype}) that a non-blocking "
            f"device -> host copy writes was read by {name}() at {call_site()} before the "
            "emulated device synchronised; on CUDA its values may not have landed yet: "
            "synchronise first (torch.cuda.synchronize(), an event's or the stream's "
            "synchronize(), or a blocking read such as .item()), or copy with "
            "runtime.to_host (blocking)"
        )


def mark_pending(host: torch.Tensor) -> None:
    """``host`` is written by a non-blocking device -> host copy from now until it lands."""
    entry = _PENDING.get(id(host))
    original = entry[2] if entry is not None and entry[1]() is host else type(host)
    _PENDING[id(host)] = (_COPIES[0], weakref.ref(host), original)
    _COPIES[0] += 1
    host.__class__ = PendingHost


def land(before: int | None = None) -> None:
    """The non-blocking copies issued before copy number ``before`` (all when None) have
    landed: their host tensors are plain tensors again."""
    for key, (number, ref, original) in list(_PENDING.items()):
        if (before is None or number < before) and _PENDING.pop(key, None) is not None:
            host = ref()
            if host is not None:
                host.__class__ = original


class Event:
    """``torch.emu.Event``: ``record`` marks the copies issued so far (one stream per device);
    ``synchronize`` (or a ``query``) lands them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._copies: int | None = None

    def record(self, stream: Any = None) -> None:
        self._copies = _COPIES[0]

    def synchronize(self) -> None:
        if self._copies is not None:
            land(self._copies)

    def query(self) -> bool:
        self.synchronize()
        return True


class Stream:
    """``torch.emu.current_stream()``: the device's one stream."""

    def synchronize(self) -> None:
        land()


def pending_copies() -> bool:
    """Whether a non-blocking device -> host copy has not landed yet."""
    return bool(_PENDING)
