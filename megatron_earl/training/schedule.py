"""Run Megatron's forward-backward schedule (no PP, 1F1B or interleaved) over micro-batches.

A micro-batch is a dict of tensors with at least ``tokens`` [b, s] and ``position_ids`` [b, s];
a ``LossFn`` turns the last stage's vocab-parallel logits [b, s, V/tp] and the micro-batch into a
scalar loss and a dict of metrics. ``token_logprobs`` gives per-token log-probs of target tokens
(vocab-parallel over TP, exact w.r.t. a TP=1 model).

Which ranks call: every rank of the world, with the same number of micro-batches per DP rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from torch import nn

MicroBatch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position from vocab-parallel logits [..., V/tp]; differentiable.

    Megatron's ``vocab_parallel_cross_entropy`` overwrites fp32 logits in place, so it gets a
    clone when the caller still needs them (autograd does: the clone is cheap next to the matmul).
    """
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), targets)


def lm_loss(logits: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean next-token negative log-likelihood over ``loss_mask`` (``labels`` are the targets)."""
    logprobs = token_logprobs(logits, batch["labels"])
    mask = batch["loss_mask"].float()
    loss = -(logprobs * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"loss": loss.detach(), "logprobs": logprobs.detach()}


def _unwrap(chunk: nn.Module) -> nn.Module:
    return chunk.module if hasattr(chunk, "module") else chunk


def _forward_step(loss_fn: LossFn, data_iterator, model: nn.Module):
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        packed_seq_params=batch.get("packed_seq_params"),
    )

    def loss_func(output_tensor: torch.Tensor):
        loss, metrics = loss_fn(output_tensor, batch)
        return loss, metrics

    return output, loss_func


def forward_backward(
    model_chunks: list[nn.Module],
    micro_batches: list[MicroBatch],
    loss_fn: LossFn = lm_loss,
    *,
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """Forward (and backward unless ``forward_only``) over ``micro_batches``.

    Returns the metrics dict of every micro-batch on the last pipeline stage (empty list on other
    stages). Gradients accumulate into the (DDP) grad buffers; the caller steps the optimizer.
    All micro-batches must share one sequence length when pp > 1.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    tokens = micro_batches[0]["tokens"]
    iterators = [iter(micro_batches) for _ in model_chunks]
    step_fn = get_forward_backward_func()
    for chunk in model_chunks:
        _unwrap(chunk).config.variable_seq_lengths = False
    with torch.set_grad_enabled(not forward_only):
        metrics = step_fn(
            forward_step_func=partial(_forward_step, loss_fn),
            data_iterator=iterators if len(model_chunks) > 1 else iterators[0],
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=tokens.size(1),
            micro_batch_size=tokens.size(0),
            forward_only=forward_only,
        )
    return list(metrics) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else []
