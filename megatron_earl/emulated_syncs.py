"""Device -> host synchronisations on the emulation tier, counted by kind and by call site.

    from megatron_earl import emulated_device
    with emulated_device.host_syncs() as syncs:      # in a rank running the tier
        step()
    syncs.total                  # syncs a GPU would pay (every kind but TO_DEVICE)
    syncs.by_kind()              # {SyncKind.ITEM: 12, SyncKind.TO_HOST: 3, ...}
    syncs.by_site()              # {(SyncKind.ITEM, "training/rl_step.py:401 in _train"): 2, ...}
    syncs.read_bytes             # bytes the copies and ``.tolist()`` reads brought to the host

On CUDA the host waits for the device's stream whenever it reads a value the device computed:
``.item()`` and ``float()/int()/bool()`` of a device tensor, ``.tolist()``, ``torch.equal``, a
blocking device -> host copy, and ops whose output size depends on device values (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without an output
size). ``emulated_device`` sees every one of them as an aten op (or ``EmuTensor.tolist``) and
reports it here (``record``) while a ``host_syncs()`` block is open; outside one it pays one
truth test of a list per op.

A blocking host -> device copy (``.to(device)`` of pageable memory) also waits for the stream on
CUDA (torch synchronises after the copy), but ``runtime.to_device`` copies pinned memory without
blocking there, while the tier, which cannot pin, copies blocking: such copies are counted as
``TO_DEVICE``, apart from ``total``, to see where host data enters (e.g. once per layer or once
per micro-batch), not as syncs. Imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator


class SyncKind(enum.Enum):
    """What made the host wait for the device."""

    ITEM = "item"
    """``.item()``, ``float()/int()/bool()`` of a device tensor (``aten::_local_scalar_dense``,
    ``aten::is_nonzero``)."""
    TOLIST = "tolist"
    """``.tolist()`` of a device tensor."""
    EQUAL = "equal"
    """``torch.equal`` of device tensors."""
    NONZERO = "nonzero"
    """``nonzero`` / ``argwhere`` without a size, and indexing with a device boolean mask."""
    MASKED_SELECT = "masked_select"
    UNIQUE = "unique"
    REPEAT_INTERLEAVE = "repeat_interleave"
    """``repeat_interleave`` with device repeats and no ``output_size``."""
    TO_HOST = "to_host"
    """A blocking device -> host copy (``.cpu()``, ``.to("cpu")``, ``host.copy_(device)``)."""
    SYNCHRONIZE = "synchronize"
    """An explicit ``torch.cuda.synchronize()`` (``torch.emu.synchronize()``)."""
    TO_DEVICE = "to_device"
    """A blocking host -> device copy: not in ``total`` (module docstring)."""


OP_KINDS = {
    "aten::_local_scalar_dense": SyncKind.ITEM,
    "aten::is_nonzero": SyncKind.ITEM,
    "aten::equal": SyncKind.EQUAL,
    "aten::nonzero": SyncKind.NONZERO,
    "aten::argwhere": SyncKind.NONZERO,
    "aten::masked_select": SyncKind.MASKED_SELECT,
    "aten::_unique": SyncKind.UNIQUE,
    "aten::_unique2": SyncKind.UNIQUE,
    "aten::unique_dim": SyncKind.UNIQUE,
    "aten::unique_consecutive": SyncKind.UNIQUE,
}
"""aten ops (by schema name) that sync whenever a device tensor reaches them."""
_COUNTERS: list[HostSyncs] = []
"""The open ``host_syncs()`` blocks, innermost last: empty but while one is open."""
_LOCK = threading.Lock()
_ROOT = os.path.dirname(os.path.abspath(__file__))
_MACHINERY = frozenset(
    os.path.join(_ROOT, name)
    for name in (
        "emulated_device.py",
        "emulated_copies.py",
        "emulated_syncs.py",
        "device_policy.py",
    )
) | {os.path.join(os.path.dirname(_ROOT), "patches", "cpu_redirect.py")}
"""Files a call site is never in: the tier, ``runtime.to_host`` / ``to_device`` (their callers
are the sites) and the CUDA redirect."""


class HostSyncs:
    """The syncs seen while a ``host_syncs()`` block was open (every thread of the process: the
    embedded engine may step on its own thread)."""

    def __init__(self) -> None:
        self.events: Counter[tuple[SyncKind, str]] = Counter()
        """(kind, call site) -> count."""
        self.bytes: Counter[tuple[SyncKind, str]] = Counter()
        """(kind, call site) -> bytes read to the host (``TO_HOST`` and ``TOLIST``)."""

    @property
    def read_bytes(self) -> int:
        """Bytes the counted device -> host copies and ``.tolist()`` reads carried."""
        return sum(n for (kind, _), n in self.bytes.items() if kind is not SyncKind.TO_DEVICE)

    @property
    def total(self) -> int:
        """Syncs a GPU would pay: every kind but ``TO_DEVICE``."""
        return sum(n for (kind, _), n in self.events.items() if kind is not SyncKind.TO_DEVICE)

    def by_kind(self) -> dict[SyncKind, int]:
        out: Counter[SyncKind] = Counter()
        for (kind, _), n in self.events.items():
            out[kind] += n
        return dict(out)

    def by_site(self) -> dict[tuple[SyncKind, str], int]:
        return dict(self.events.most_common())

    def count(self, kind: SyncKind) -> int:
        return self.by_kind().get(kind, 0)


@contextlib.contextmanager
def host_syncs() -> Iterator[HostSyncs]:
    """Count the device -> host syncs of the block (module docstring); blocks may nest, each
    counts what happens while it is open."""
    counter = HostSyncs()
    with _LOCK:
        _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        with _LOCK:
            _COUNTERS.remove(counter)


def counting() -> bool:
    """Whether a ``host_syncs()`` block is open (the tier's check before ``record``)."""
    return bool(_COUNTERS)


def record(kind: SyncKind, nbytes: int = 0) -> None:
    """One sync of ``kind`` at the current call site, in every open block; ``nbytes``: what a
    copy or ``.tolist()`` carried."""
    site = call_site()
    with _LOCK:
        for counter in _COUNTERS:
            counter.events[kind, site] += 1
            if nbytes:
                counter.bytes[kind, site] += nbytes


def call_site() -> str:
    """Where the sync was asked for: the innermost frame outside the tier and torch, followed by
    the innermost megatron_earl frame when that is another one (``megatron/core/...:12 in f
    (from megatron_earl/training/schedule.py:99 in g)``)."""
    frame = sys._getframe(1)
    inner = ours = None
    while frame is not None and ours is None:
        path = frame.f_code.co_filename
        if path not in _MACHINERY and "/torch/" not in path:
            inner = inner or frame
            if path.startswith(_ROOT):
                ours = frame
        frame = frame.f_back
    if inner is None:
        return "unknown"
    where = _describe(inner)
    return where if ours is None or ours is inner else f"{where} (from {_describe(ours)})"


def _describe(frame) -> str:
    path = frame.f_code.co_filename
    if path.startswith(_ROOT):
        path = os.path.relpath(path, os.path.dirname(_ROOT))
    elif "/site-packages/" in path:
        path = path.split("/site-packages/", 1)[1]
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
