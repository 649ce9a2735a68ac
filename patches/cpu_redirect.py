"""A scoped CUDA -> CPU redirect around the Megatron-Core functions that hard-code CUDA (machines
without CUDA only).

What: every function in ``_REDIRECTED`` is wrapped so that it runs inside ``cuda_to_cpu()``: a
  ``TorchFunctionMode`` that rewrites CUDA device arguments to CPU, turns ``pin_memory`` off, makes
  ``Tensor.cuda()`` a no-op and ``Tensor.type()`` report ``torch.cuda.*`` types, plus temporary
  stand-ins for ``torch.cuda.current_device`` / ``synchronize`` / ``empty_cache`` and for CUDA
  streams (``Stream``, ``current_stream``, ``stream``: one in-order stream, whose events
  synchronise like ``synchronize``; the MoE all-to-all token dispatcher copies its split sizes to
  the host on a side stream). The redirect is
  active *only* while a wrapped function runs (or a call site enters ``cuda_to_cpu()`` itself, as
  checkpointing does around the distributed optimizer's state (de)sharding); nothing outside
  those calls changes. Inside a redirected pipeline schedule, each micro-batch's
  ``forward_step`` / ``backward_step`` runs without the mode (``_EXEMPTED``: under it every op
  of the model's forward and backward paid a Python ``__torch_function__`` call -- ~4% of a
  demo-sized train step). The ``torch.cuda`` stand-ins stay on there: the layers ask
  ``torch.cuda.current_device()`` (e.g. the sequence-parallel linear's backward); the pieces
  the model calls that need the mode itself (``device="cuda"``, ``pin_memory``) are in
  ``_REDIRECTED`` and open their own scope. Applied once, for the life
  of the process.
Why: megatron-core hard-codes CUDA in a handful of places (``device="cuda"``,
  ``torch.cuda.current_device()``, ``.cuda()``, ``torch.cuda.synchronize()``, type checks against
  ``torch.cuda.FloatTensor``). Developers and CI of this project have no GPU, yet tests must run
  *real* megatron-core.
Versions: megatron-core>=0.16.0,<0.17.0 (each wrapped function was observed to fail on a CPU-only
  torch build with megatron-core 0.16.1).
Test: tests/distributed/test_moe.py (test_ep2_logits_equal_ep1: the router, the all-to-all
  dispatcher and the all-to-all-v outside a schedule), tests/unit/test_patches.py
  (test_redirect_is_scoped_to_wrapped_functions,
  test_schedule_steps_run_without_the_redirect); every
  distributed test runs through it (e.g. tests/distributed/test_model_parallel.py)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"

# Every Megatron-Core function that hard-codes CUDA and runs under the redirect.
_REDIRECTED: tuple[tuple[str, str], ...] = (
    ("megatron.core.utils", "GlobalMemoryBuffer.get_tensor"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb"),
    # YaRN's override (it moves its two frequency tables to torch.cuda.current_device()).
    (
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        "YarnRotaryEmbedding.get_emb",
    ),
    # CP slicing of the RoPE table (pin_memory + .cuda()); patched where RotaryEmbedding.forward
    # looks it up, so the lru_cache on forward stays untouched.
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
    (
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        "get_pos_emb_on_this_cp_rank",
    ),
    ("megatron.core.fusions.fused_softmax", "FusedScaleMaskSoftmax.forward_torch_softmax"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_last_dim"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_last_dim"),
    ("megatron.core.tensor_parallel.mappings", "all_to_all"),
    # The all-to-all-v output (device=torch.cuda.current_device()): the MoE token dispatcher
    # imported ``all_to_all`` by name before the patch, and the backward calls the Function itself.
    ("megatron.core.tensor_parallel.mappings", "_AllToAll.forward"),
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
    # Mixture of experts: the router moves a host weight to torch.cuda.current_device(); the
    # all-to-all dispatcher makes a CUDA side stream and copies its split sizes to the host on it.
    ("megatron.core.transformer.moe.router", "Router.gating"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__"),
    (
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    ),
)

# Called inside a redirected schedule, but CUDA-free themselves: one forward or backward of a
# micro-batch runs with the redirect off (the model's CUDA-bound pieces above still open their
# own scope). Under the mode every torch call of the whole forward and backward went through
# ``__torch_function__`` in Python.
_EXEMPTED: tuple[tuple[str, str], ...] = (
    ("megatron.core.pipeline_parallel.schedules", "forward_step"),
    ("megatron.core.pipeline_parallel.schedules", "backward_step"),
)

TARGETS = tuple(Target(module, path) for module, path in _REDIRECTED + _EXEMPTED)

_APPLIED = False
_LOCK = threading.Lock()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_FROM_DATA = frozenset({"tensor", "as_tensor"})
_TARGET: list[torch.device] = [torch.device("cpu")]
"""Where CUDA requests go: the CPU, or the emulated device under the emulation tier."""


def set_target(device: torch.device) -> None:
    """Redirect CUDA requests to ``device`` (``runtime.initialize`` sets the compute device)."""
    _TARGET[0] = torch.device(device)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the target (the CPU, or the emulated device) for every
    torch function called inside the mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = _TARGET[0]
        if func is torch.Tensor.cuda:
            return args[0].to(target)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron checks ``param.type() == 'torch.cuda.FloatTensor'``.
            host_name = torch.empty(0, dtype=args[0].dtype).type()
            return host_name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            if getattr(func, "__name__", "") in _FROM_DATA and target.type != "cpu":
                # Built on the host and copied: the emulated device cannot build from data.
                kwargs["device"] = "cpu"
                return func(*args, **kwargs).to(target)
            kwargs["device"] = target
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], target, *args[2:])
        return func(*args, **kwargs)


_REDIRECT_DEPTH = threading.local()


def _synchronize(*args: Any, **kwargs: Any) -> None:
    """``torch.cuda.synchronize`` on the target: nothing on the CPU; on the emulated device its
    pending non-blocking device -> host copies land (Megatron's checkpoint preload copies
    non-blocking, then synchronises)."""
    if _TARGET[0].type != "cpu":
        torch.get_device_module(_TARGET[0].type).synchronize()


class _InOrderStream:
    """Stand-in for a CUDA stream on a device whose work runs in program order (the CPU, the
    emulated device): waiting is free; an event synchronises like ``torch.cuda.synchronize``."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _InOrderEvent:
        return _InOrderEvent()

    def synchronize(self) -> None:
        _synchronize()


class _InOrderEvent:
    def synchronize(self) -> None:
        _synchronize()

    def wait(self, stream: Any = None) -> None:
        pass


_STREAM = _InOrderStream()


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
    target = "cpu" if _TARGET[0].type == "cpu" else _TARGET[0]
    stand_ins = {
        "current_device": lambda: target,
        "synchronize": _synchronize,
        "empty_cache": lambda: None,
        "Stream": lambda *args, **kwargs: _STREAM,
        "current_stream": lambda device=None: _STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
    }
    saved = {name: getattr(torch.cuda, name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        setattr(torch.cuda, name, stand_in)
    _REDIRECT_DEPTH.value = 1
    try:
        with _CudaToCpuMode():
            yield
    finally:
        _REDIRECT_DEPTH.value = 0
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """The redirect's mode off in this thread inside the body, when the redirect is on and its
    mode is the innermost torch-function mode; the ``torch.cuda`` stand-ins stay installed (the
    body may ask ``current_device``). A wrapped function called in the body opens its own scope
    (depth 0 here)."""
    depth = getattr(_REDIRECT_DEPTH, "value", 0)
    if not depth or torch._C._len_torch_function_stack() == 0:
        yield
        return
    mode = torch._C._pop_torch_function_stack()
    if not isinstance(mode, _CudaToCpuMode):  # another mode inside ours: leave both on
        torch._C._push_on_torch_function_stack(mode)
        yield
        return
    _REDIRECT_DEPTH.value = 0
    try:
        yield
    finally:
        _REDIRECT_DEPTH.value = depth
        torch._C._push_on_torch_function_stack(mode)


def _scoped(fn: Callable, scope: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    """``fn`` run inside ``scope()``, marked as installed by this patch."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with scope():
            return fn(*args, **kwargs)

    wrapper.__megatron_earl_redirected__ = True  # type: ignore[attr-defined]
    return wrapper


def _redirected(fn: Callable) -> Callable:
    return _scoped(fn, cuda_to_cpu)


def _exempted(fn: Callable) -> Callable:
    return _scoped(fn, _suspended)


def apply() -> bool:
    """Wrap every function in ``_REDIRECTED`` (and exempt those in ``_EXEMPTED``) when CUDA is
    unavailable; True when the wrappers are installed. Idempotent. Local (every process applies
    it for itself)."""
    global _APPLIED
    check_targets(__name__, VERSIONS, TARGETS)
    if torch.cuda.is_available():
        return False
    with _LOCK:
        for target in TARGETS:
            original = target.get()
            static = isinstance(original, staticmethod)  # an autograd Function's forward
            fn = original.__func__ if static else original
            if not getattr(fn, "__megatron_earl_redirected__", False):
                exempt = (target.module, target.path) in _EXEMPTED
                wrapped = _exempted(fn) if exempt else _redirected(fn)
                target.set(staticmethod(wrapped) if static else wrapped)
        _APPLIED = True
    return True


def when_applied() -> contextlib.AbstractContextManager:
    """``cuda_to_cpu()`` when this patch is applied (no CUDA), else a no-op context, for call sites
    that run CUDA-hard-coded Megatron code outside the wrapped functions."""
    return cuda_to_cpu() if _APPLIED else contextlib.nullcontext()
