"""The MoE all-to-all token dispatcher gets its split sizes as host integers on a non-CUDA device.

What: replaces the name ``maybe_move_tensor_to_cpu`` inside
  ``megatron.core.transformer.moe.token_dispatcher`` (the dispatcher's only use of it) with a
  version that treats every non-host tensor as "on the device" (not only ``tensor.is_cuda``) and
  honours ``as_numpy`` for a tensor already on the host. Blocking copy: the CPU and the emulated
  device run in program order. Applied on machines without CUDA only.
Why: ``MoEAlltoAllTokenDispatcher`` computes its all-to-all split sizes as tensors and relies on
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` to turn them into a host array, but that
  function only acts on CUDA tensors: on the CPU the sizes stay torch tensors and
  ``torch.distributed.all_to_all_single`` rejects them ("incompatible function arguments").
Versions: megatron-core>=0.16.0,<0.17.0 (observed with megatron-core 0.16.1, torch 2.13 CPU, gloo,
  expert_model_parallel_size 2).
Test: tests/distributed/test_moe.py (test_moe_model_trains_at_ep1_and_ep2,
  test_ep2_logits_equal_ep1)
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
TARGETS = (Target("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),)


def host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``tensor`` on the host (a numpy array with ``as_numpy``); anything else unchanged.
    ``record_stream`` has nothing to do where work runs in program order."""
    if not torch.is_tensor(tensor):
        return tensor
    host = tensor.to("cpu") if tensor.device.type != "cpu" else tensor
    return host.numpy() if as_numpy else host


def apply() -> bool:
    """Install ``host_copy`` in the dispatcher's module when CUDA is unavailable; True when
    installed. Idempotent. Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    if torch.cuda.is_available():
        return False
    module = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    module.maybe_move_tensor_to_cpu = host_copy
    return True
