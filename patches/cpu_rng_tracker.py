"""A CPU RNG tracker in place of Megatron-Core's CUDA one (machines without CUDA only).

What: ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker`` becomes
  ``CpuRNGStatesTracker``: ``fork(name)`` swaps a per-name CPU generator state into the default CPU
  generator, so dropout inside TP regions uses the tensor-parallel seed.
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` are pointed at the CPU generator, so
  activation recompute (``CheckpointFunction``) replays dropout exactly. The tracker is then
  re-initialised (``initialize_rng_tracker(force_reset=True)``) so it is an instance of the new
  class. Applied once, for the life of the process.
Why: megatron-core keeps its tracked RNG states as CUDA generator states; developers and CI of this
  project have no GPU, yet tests must run *real* megatron-core, with the same per-TP-rank dropout
  streams as on a GPU.
Versions: megatron-core>=0.16.0,<0.17.0 (written against 0.16.1).
Test: tests/distributed/test_cpu_rng.py (test_fork_swaps_per_name_cpu_states,
  test_recompute_with_dropout_reproduces_gradients_exactly)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
_MODULE = "megatron.core.tensor_parallel.random"
TARGETS = (
    Target(_MODULE, "CudaRNGStatesTracker"),
    Target(_MODULE, "_MODEL_PARALLEL_RNG_TRACKER_NAME"),
    Target(_MODULE, "_get_cuda_rng_state"),
    Target(_MODULE, "_set_cuda_rng_state"),
    Target(_MODULE, "initialize_rng_tracker"),
)
_TRACKER, _NAME, _GET_STATE, _SET_STATE, _INITIALIZE = TARGETS

_LOCK = threading.Lock()


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class() -> type:
    base = _TRACKER.get()
    default_name = _NAME.get()

    class CpuRNGStatesTracker(base):  # type: ignore[valid-type, misc]
        """Megatron's RNG tracker, keeping one CPU generator state per name."""

        def __init__(
            self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False
        ):
            if use_cudagraphable_rng:
                raise ValueError("use_cudagraphable_rng=True needs CUDA; it is not valid on CPU")
            super().__init__(False, is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"rng seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"rng state {name!r} is already tracked")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = default_name) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(
                    f"rng state {name!r} is not tracked; tracked: {sorted(self.states_)}"
                )
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def apply() -> bool:
    """Install the CPU tracker when CUDA is unavailable; True when it is installed. Idempotent.
    Local (every process applies it for itself)."""
    check_targets(__name__, VERSIONS, TARGETS)
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if getattr(_TRACKER.get(), "__name__", "") != "CpuRNGStatesTracker":
            _TRACKER.set(_make_cpu_tracker_class())
            _GET_STATE.set(_get_cpu_rng_state)
            _SET_STATE.set(_set_cpu_rng_state)
            _INITIALIZE.get()(force_reset=True)
    return True
