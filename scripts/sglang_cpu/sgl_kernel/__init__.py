"""A pure-Python stand-in for ``sgl_kernel`` (the ``sglang-kernel`` package) on a CPU without it.

Installed into the SGLang venv by ``scripts/install_sglang_cpu.sh``; nothing in megatron-earl
imports it. Why it exists: SGLang's CPU path (``--device cpu`` with ``SGLANG_USE_CPU_ENGINE=1``,
checked on 0.5.23) imports ``sgl_kernel`` at module level, but only CUDA wheels of sgl-kernel are
published (its CPU build has no wheel and needs AVX-512/AMX). Of what that path imports it calls
one op, ``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``), implemented
here with plain torch. The other names it imports (``copy_all_layer_kv_cache_cpu`` and ~20 AMX
kernels) are only called with the real CPU build on an AMX machine: SGLang turns its AMX backend
on only when ``torch.ops.sgl_kernel.convert_weight_packed`` exists, which this package never
registers. Those names resolve to placeholders that raise ``NotImplementedError`` naming the op
when called. The real package's submodules (``sgl_kernel.kvcacheio``, ...) are absent, so
importing one raises ``ImportError`` and SGLang takes its fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SUBMODULES = frozenset(
    {
        "allreduce",
        "attention",
        "cpu",
        "cutlass_moe",
        "elementwise",
        "flash_attn",
        "flash_mla",
        "fused_moe",
        "gemm",
        "grammar",
        "kvcacheio",
        "load_utils",
        "mamba",
        "marlin",
        "memory",
        "moe",
        "quantization",
        "sampling",
        "scalar_type",
        "spatial",
        "speculative",
        "top_k",
        "utils",
        "version",
    }
)
"""Submodule names of the real ``sgl_kernel``: ``from sgl_kernel import kvcacheio`` must fail with
ImportError (as ``import sgl_kernel.kvcacheio`` does) rather than yield an op placeholder."""


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    For request i: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` becomes
    the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the slots of all
    requests, concatenated in request order). ``pool_len`` is the row length of
    ``req_to_token``, which the tensor already carries."""
    del pool_len
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        num_new = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + num_new]
        offset += num_new


def _missing_op(name: str) -> Callable[..., None]:
    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but the CPU build of sgl-kernel is not installed: "
            "this sgl_kernel is megatron-earl's pure-Python stand-in "
            "(scripts/sglang_cpu/sgl_kernel), which implements only "
            "assign_req_to_token_pool_cpu"
        )

    missing.__name__ = missing.__qualname__ = name
    return missing


def __getattr__(name: str) -> Callable[..., None]:
    if name.startswith("__") or name in SUBMODULES:
        raise AttributeError(f"module 'sgl_kernel' has no attribute '{name}'")
    op = _missing_op(name)
    globals()[name] = op
    return op
