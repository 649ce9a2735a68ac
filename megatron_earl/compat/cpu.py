"""Runtime patches that let megatron-core run on a CPU-only torch build (gloo, no CUDA).

Why: megatron-core hard-codes CUDA in a handful of places (``device="cuda"``,
``torch.cuda.current_device()``, ``.cuda()``, ``torch.cuda.synchronize()``, type checks against
``torch.cuda.FloatTensor``) and keeps its RNG states as CUDA generator states. Developers and CI of
this project have no GPU, yet tests must run *real* megatron-core.

Versions: written against and tested with megatron-core 0.16.1 (see ``SUPPORTED_MCORE``).

What it does, and nothing more:

1. ``CpuRNGStatesTracker`` replaces Megatron's CUDA RNG tracker. ``fork(name)`` swaps a per-name
   CPU generator state into the default CPU generator, so dropout inside TP regions uses the
   tensor-parallel seed; Megatron's ``_get_cuda_rng_state``/``_set_cuda_rng_state`` are pointed at
   the CPU generator, so activation recompute (``CheckpointFunction``) replays dropout exactly.
2. A scoped CUDA -> CPU redirect (``cuda_to_cpu()``): a ``TorchFunctionMode`` that rewrites CUDA
   device arguments to CPU and makes ``Tensor.cuda()`` a no-op, plus temporary stand-ins for
   ``torch.cuda.current_device``/``synchronize``/``empty_cache``. It is active *only* while one
   of the wrapped Megatron functions in ``_REDIRECTED`` runs; nothing outside those calls changes.

``apply()`` is explicit (called by ``megatron_earl.runtime.initialize`` and the test harness) and is
a no-op when CUDA is available. It is idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_LOCK = threading.Lock()

# (module, attribute path) of every Megatron function that hard-codes CUDA and runs under the
# redirect. Each entry was observed to fail on a CPU-only build of torch with megatron-core 0.16.1.
_REDIRECTED: tuple[tuple[str, str], ...] = (
    ("megatron.core.utils", "GlobalMemoryBuffer.get_tensor"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb"),
    # CP slicing of the RoPE table (pin_memory + .cuda()); patched where RotaryEmbedding.forward
    # looks it up, so the lru_cache on forward stays untouched.
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.fusions.fused_softmax", "FusedScaleMaskSoftmax.forward_torch_softmax"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_last_dim"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_last_dim"),
    ("megatron.core.tensor_parallel.mappings", "all_to_all"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    (
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
    ),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving"),
    ("megatron.core.dist_checkpointing.serialization", "save"),
    ("megatron.core.dist_checkpointing.serialization", "load"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.__init__"),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer.__init__"),
    ("megatron.core.optimizer", "get_megatron_optimizer"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.get_loss_scale"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.step"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.step"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.step"),
    ("megatron.core.optimizer.optimizer", "ChainedOptimizer.step"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
    ),
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch function called inside the mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron checks ``param.type() == 'torch.cuda.FloatTensor'``.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_REDIRECT_DEPTH = threading.local()


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Run the body with CUDA device requests mapped to CPU (re-entrant, per thread)."""
    depth = getattr(_REDIRECT_DEPTH, "value", 0)
    if depth:
        _REDIRECT_DEPTH.value = depth + 1
        try:
            yield
        finally:
            _REDIRECT_DEPTH.value = depth
        return
    saved = {
        name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "empty_cache")
    }
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
    _REDIRECT_DEPTH.value = 1
    try:
        with _CudaToCpuMode():
            yield
    finally:
        _REDIRECT_DEPTH.value = 0
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def _redirected(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_to_cpu():
            return fn(*args, **kwargs)

    wrapper.__megatron_earl_redirected__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch_redirects() -> None:
    for module_name, path in _REDIRECTED:
        owner: Any = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if getattr(original, "__megatron_earl_redirected__", False):
            continue
        setattr(owner, attr, _redirected(original))


# ----------------------------------------------------------------------------- RNG


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    default_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

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


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom.CudaRNGStatesTracker, "__name__", "") == "CpuRNGStatesTracker":
        return
    mrandom.CudaRNGStatesTracker = _make_cpu_tracker_class()
    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    mrandom.initialize_rng_tracker(force_reset=True)


def apply() -> bool:
    """Install the CPU patches when CUDA is unavailable. Returns True when patches are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _APPLIED:
            return True
        _patch_rng()
        _patch_redirects()
        _APPLIED = True
    return True


def is_applied() -> bool:
    return _APPLIED
