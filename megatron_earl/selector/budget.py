"""The project-enforced device-memory budget on CPU: measure a phase's peak, raise an OOM past it.

    budget = MemoryBudget(limit_bytes=256 << 20)
    budget.check_predicted(predicted_peak, layout)          # before the phase: raises, no work done
    with budget.track(static_bytes=state_bytes(chunks, optimizer)) as tracker:
        optimizer = budget.guard_optimizer(optimizer)        # train: checkpoint before the update
        run_phase(...)
    budget.checkpoint()                                      # forward-only phases: at the end

How the limit is enforced (a CPU has no allocator that fails at a limit, so the project does):

1. **Predicted, before the phase** (``check_predicted``): the memory model's peak for the phase is
   compared with the limit on every rank from the same inputs, so every rank raises or none does.
2. **Measured, during the phase** (``track``): a ``TorchDispatchMode`` sees every tensor every
   ATen op creates (forward, backward, collectives) and adds its storage's bytes to a live counter
   when the storage is new, subtracting them when the storage is freed (a ``weakref.finalize`` on
   the storage: torch keeps one Python object per storage, so it dies with the storage). The peak
   of that counter, plus the bytes of the state that lives across phases (``static_bytes``:
   parameters, gradient buffers, optimizer state, counted from the real tensors by
   ``state_bytes``), is the measured peak: the CPU analogue of ``torch.cuda.max_memory_allocated``.
3. **Agreed at a checkpoint** (``checkpoint``): the measured peaks are all-reduced (MAX) over the
   world, and if the largest exceeds the limit every rank raises ``BudgetExceeded`` (a
   ``torch.OutOfMemoryError``). A train phase calls it just before ``optimizer.step()``
   (``guard_optimizer``), so an over-budget step applies no update and can be re-run on the same
   data in another layout; forward-only phases call it at their end. Raising at the allocation
   itself would leave the other ranks waiting in a collective: the checkpoint keeps every rank in
   step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.oom_agreement import agreement_point


class BudgetExceeded(torch.OutOfMemoryError):
    """A phase's predicted or measured peak exceeds the project-enforced memory budget."""

    def __init__(self, message: str, *, peak_bytes: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.peak_bytes = peak_bytes
        self.limit_bytes = limit_bytes


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created by ATen ops while active, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._seen or key == 0:
                continue
            nbytes = storage.nbytes()
            self._seen.add(key)
            self.live += nbytes
            weakref.finalize(storage, self._free, key, nbytes)
        self.peak = max(self.peak, self.live)
        return out


@dataclass
class PhaseMeasurement:
    """What ``MemoryBudget.track`` measured on this rank."""

    static_bytes: int
    """Bytes of the state living across phases (parameters, gradient buffers, optimizer state)."""
    dynamic_peak_bytes: int = 0
    """Peak bytes of tensors created during the phase and alive at the same time."""

    @property
    def peak_bytes(self) -> int:
        return self.static_bytes + self.dynamic_peak_bytes


class MemoryBudget:
    """A per-rank device-memory limit the project enforces on CPU (module docstring)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self.current: PhaseMeasurement | None = None
        self._mode: _LiveBytes | None = None

    def check_predicted(self, predicted_bytes: float, what: str = "phase") -> None:
        """Raise ``BudgetExceeded`` if a predicted peak exceeds the limit (no communication)."""
        if predicted_bytes > self.limit_bytes:
            raise BudgetExceeded(
                f"{what}: predicted peak {predicted_bytes / 2**20:.1f} MiB > budget "
                f"{self.limit_bytes / 2**20:.1f} MiB",
                peak_bytes=int(predicted_bytes),
                limit_bytes=self.limit_bytes,
            )

    @contextlib.contextmanager
    def track(self, static_bytes: int = 0) -> Iterator[PhaseMeasurement]:
        """Measure the peak of tensors created inside the block (no communication)."""
        measurement = PhaseMeasurement(static_bytes=int(static_bytes))
        mode = _LiveBytes()
        self.current, self._mode = measurement, mode
        try:
            with mode:
                yield measurement
        finally:
            measurement.dynamic_peak_bytes = mode.peak
            self._mode = None

    def measured_peak(self) -> int:
        """This rank's measured peak so far in the current (or last) ``track`` block."""
        if self.current is None:
            return 0
        dynamic = self._mode.peak if self._mode is not None else self.current.dynamic_peak_bytes
        return self.current.static_bytes + dynamic

    def agreed_peak(self, group: dist.ProcessGroup | None = None) -> int:
        """The measured peak, max over ``group`` (default: the world), without enforcing the
        limit. Which ranks call: every rank of ``group`` (one all-reduce on its host twin)."""
        peak = torch.tensor([float(self.measured_peak())], dtype=torch.float64, device="cpu")
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=host_group(group))
        return int(peak.item())

    def checkpoint(self, group: dist.ProcessGroup | None = None) -> int:
        """All-reduce (MAX) the measured peak; past the limit, ``BudgetExceeded`` on every rank.
        First an OOM agreement point (``parallel.oom_agreement``: under the selector's recovery,
        ``PeerOutOfMemory`` on every rank when another rank ran out of memory).

        Which ranks call: every rank of ``group`` (default: the world) and of the agreement's
        group (the world). Returns the largest peak.
        """
        agreement_point()
        largest = self.agreed_peak(group)
        if largest > self.limit_bytes:
            raise BudgetExceeded(
                f"measured peak {largest / 2**20:.1f} MiB > budget "
                f"{self.limit_bytes / 2**20:.1f} MiB",
                peak_bytes=largest,
                limit_bytes=self.limit_bytes,
            )
        return largest

    def guard_optimizer(self, optimizer: Any, group: dist.ProcessGroup | None = None) -> Any:
        """``optimizer`` whose ``step()`` first runs ``checkpoint`` (every rank of ``group``)."""
        return _GuardedOptimizer(optimizer, self, group)


class _GuardedOptimizer:
    """Forwards everything to the optimizer; ``step`` checks the budget before updating."""

    def __init__(self, optimizer: Any, budget: MemoryBudget, group: Any) -> None:
        self._optimizer, self._budget, self._group = optimizer, budget, group

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._budget.checkpoint(self._group)
        return self._optimizer.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def state_bytes(chunks: list[torch.nn.Module], optimizer: Any = None) -> int:
    """Bytes of the distinct storages of the chunks' parameters and buffers, Megatron DDP's grad
    buffers, and the optimizer's state tensors (counted once each)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() != 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for chunk in chunks:
        module = unwrap_chunk(chunk)
        for t in [*module.parameters(), *module.buffers()]:
            add(t)
            add(getattr(t, "main_grad", None))
        ddp_buffers = getattr(chunk, "buffers", None)
        for buffer in ddp_buffers if isinstance(ddp_buffers, list) else []:
            add(getattr(buffer, "grad_data", None))
            add(getattr(buffer, "param_data", None))
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            for value in state.values():
                add(value)
        for group in inner.param_groups:
            for p in group["params"]:
                add(p)
    return total
