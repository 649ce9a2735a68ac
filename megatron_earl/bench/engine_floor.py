"""The projection floor of a prefill run, for ``megatron-earl bench engine --floor``: the matrix
products the embedded engine's prefill forward runs, timed alone on this rank's weights.

    calls = prefill_run_projections(model_chunk, sequences=64, prompt_len=32,
                                    max_prefill_tokens=8192)
    seconds = time_projections(calls)

Why: at the demo model's size (hidden 128) a prefill step is projection-bound. Whatever the
engine's attention, norms, kernels or scheduling do, its prefill forward as it is runs these
products, so HF's prefill time over theirs bounds the ours/HF prefill ratio ``bench engine``
reports (``bench/engine.py``), measured on the same machine in the same rounds. It bounds this
forward, not every possible one: a forward that computed fewer products (e.g. the last layer's
queries on the returned tokens only, ~2% of them at the demo's size) would have a lower floor.

The products are those of ``BatchedForward._prefill`` returning each sequence's last token: every
layer's fused QKV projection on all new tokens; every layer but the last also its output
projection and both MLP projections on all of them; the last layer's output projection and MLP,
and the output layer, on the returned tokens only. Each runs as ``F.linear`` on this rank's shards
of the Megatron modules' own parameters and a random input of its shape, allocated before the
clock starts, with the biases the forward adds inside the product (QKV's, fc1's, the output
layer's; the output projection's and fc2's come after the TP reduction, a separate add); the
products' outputs are allocated as the forward allocates them. Not counted: the attention's
batched products, norms, RoPE, SwiGLU, the KV-cache writes, the TP collectives and all host work.
With TP, a rank's shards on that rank's threads: one rank's part of every step. Wall time with no
device synchronisation: ``bench engine`` runs on the CPU. Pure local code: no collective.
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
    """Added inside the product (``F.linear``'s bias), or None."""


def prefill_steps(sequences: int, prompt_len: int, max_prefill_tokens: int) -> list[int]:
    """Sequences per prefill step of a run of ``sequences`` fresh prompts of ``prompt_len``
    tokens each, as the engine's admission (``EmbeddedEngine._admit``) splits them: as many as
    keep a step within ``max_prefill_tokens`` padded tokens (at least one), in order."""
    per_step = max(1, max_prefill_tokens // prompt_len)
    return [min(per_step, sequences - first) for first in range(0, sequences, per_step)]


def prefill_run_projections(
    model: nn.Module, sequences: int, prompt_len: int, max_prefill_tokens: int
) -> list[Projection]:
    """The products of every step of a prefill run (``prefill_steps``), each sequence
    returning its last token."""
    return [
        call
        for k in prefill_steps(sequences, prompt_len, max_prefill_tokens)
        for call in prefill_projections(model, k * prompt_len, k)
    ]


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
        calls += [
            Projection(tokens, attn.linear_qkv.weight, attn.linear_qkv.bias),
            Projection(rows, attn.linear_proj.weight, None),
            Projection(rows, mlp.linear_fc1.weight, mlp.linear_fc1.bias),
            Projection(rows, mlp.linear_fc2.weight, None),
        ]
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
