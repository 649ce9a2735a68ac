"""The arithmetic floor of a prefill step, for ``megatron-earl bench engine --floor``: the matrix
products the embedded engine's prefill forward runs, timed alone on this rank's weights.

    calls = prefill_projections(model_chunk, tokens=64 * 32, returned=64)
    seconds = time_projections(calls)

Why: at the demo model's size (hidden 128) a prefill step is projection-bound. No change to the
engine's attention, norms, kernels or scheduling can make a prefill run faster than these products
alone, so HF's prefill time over theirs bounds the ours/HF prefill ratio that ``bench engine``
reports (``bench.py``), measured on the same machine in the same rounds.

The products are those of ``BatchedForward._prefill`` returning each sequence's last token: every
layer's fused QKV projection on all new tokens; every layer but the last also its output
projection and both MLP projections on all of them; the last layer's output projection and MLP,
and the output layer, on the returned tokens only. Each runs as ``F.linear`` on this rank's shards
of the Megatron modules' own parameters (with their biases) and a random input of its shape,
allocated before the clock starts; the products' outputs are allocated as the forward allocates
them. Not counted: the attention's batched products, norms, RoPE, SwiGLU, the KV-cache writes,
the TP collectives and all host work. Wall time with no device synchronisation: ``bench engine``
runs on the CPU. Pure local code: no collective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_earl.parallel.ddp import unwrap_chunk


@dataclass(frozen=True)
class Projection:
    """One matrix product of a prefill step."""

    rows: int
    """Tokens it runs on."""
    weight: torch.Tensor
    """``[out, in]``: this rank's shard of the module's weight (referenced, not copied)."""
    bias: torch.Tensor | None


def prefill_projections(model: nn.Module, tokens: int, returned: int) -> list[Projection]:
    """The products of a prefill step of ``tokens`` new tokens returning ``returned`` logits rows
    (one per sequence), in the order the forward runs them (module docstring)."""
    if not 1 <= returned <= tokens:
        raise ValueError(
            f"returned must be in [1, tokens={tokens}] (one row per sequence), got {returned}"
        )
    gpt = unwrap_chunk(model)
    layers = list(gpt.decoder.layers)
    calls: list[Projection] = []
    for i, layer in enumerate(layers):
        rows = tokens if i < len(layers) - 1 else returned
        attn, mlp = layer.self_attention, layer.mlp
        calls.append(Projection(tokens, attn.linear_qkv.weight, attn.linear_qkv.bias))
        for linear in (attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2):
            calls.append(Projection(rows, linear.weight, linear.bias))
    if gpt.share_embeddings_and_output_weights:
        output = gpt.shared_embedding_or_output_weight()
    else:
        output = gpt.output_layer.weight
    calls.append(Projection(returned, output, gpt.output_layer.bias))
    return calls


@torch.inference_mode()
def time_projections(calls: list[Projection]) -> float:
    """Wall seconds of running every product of ``calls`` once, in order, on the current torch
    threads; the inputs are random and allocated before timing."""
    inputs = [
        torch.randn(c.rows, c.weight.size(1), dtype=c.weight.dtype, device=c.weight.device)
        for c in calls
    ]
    start = time.perf_counter()
    for call, x in zip(calls, inputs, strict=True):
        F.linear(x, call.weight, call.bias)
    return time.perf_counter() - start
