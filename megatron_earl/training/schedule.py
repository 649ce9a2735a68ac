"""Run Megatron's forward-backward schedule (no PP, 1F1B or interleaved) over micro-batches.

A micro-batch is a dict of tensors with at least ``tokens`` [b, s] and ``position_ids`` [b, s];
a ``LossFn`` turns the last stage's vocab-parallel logits [b, s, V/tp] and the micro-batch into a
scalar loss and a dict of metrics. ``token_logprobs`` gives per-token log-probs of target tokens
(vocab-parallel over TP, exact w.r.t. a TP=1 model).

Which ranks call: every rank of the world, with the same number of micro-batches per DP rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from torch import nn

from megatron_earl.models.routing import (
    Disagreement,
    RouteAction,
    chunk_routers,
    filled,
    measuring,
    replaying,
    sequence_parallel_slice,
)
from megatron_earl.parallel.ddp import unwrap_chunk

MicroBatch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """log p(target) per position from vocab-parallel logits [..., V/tp]; differentiable.

    ``vocab_size``: normalise over the real vocabulary (this rank's padding rows, global ids
    ``>= vocab_size``, get -inf logits), as the RL loss (``logprobs.head_logprobs``) and the
    engines do; None keeps every row, like Megatron's own cross entropy (the SFT loss).
    Megatron's ``vocab_parallel_cross_entropy`` overwrites fp32 logits in place, so it gets a
    clone when the caller still needs them (autograd does: the clone is cheap next to the matmul).
    """
    logits = logits.float().clone()
    if vocab_size is not None:
        start = parallel_state.get_tensor_model_parallel_rank() * logits.size(-1)
        first_padded = max(0, vocab_size - start)
        if first_padded < logits.size(-1):
            logits[..., first_padded:] = float("-inf")
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` across the whole sequence, also when it is split over CP.

    With cp > 1 this rank holds 2 of 2 x cp chunks: it sums its own tokens and divides by the
    token count of the whole micro-batch (all-reduced over the CP group, not differentiated).
    Megatron's schedule multiplies a 2-tuple loss by cp and DDP averages gradients over dp x cp,
    so gradients equal those of cp = 1. Which ranks call: every rank of the CP group.
    """
    mask = mask.float()
    count = mask.sum()
    if parallel_state.get_context_parallel_world_size() > 1:
        count = count.detach().clone()
        torch.distributed.all_reduce(count, group=parallel_state.get_context_parallel_group())
    return (values * mask).sum() / count.clamp(min=1)


def lm_loss(logits: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean next-token negative log-likelihood over ``loss_mask`` (``labels`` are the targets).

    The metric ``loss`` is the whole micro-batch's mean (summed over CP); ``logprobs`` are this
    rank's tokens. (The schedule scales the returned loss in place, so the metric is a copy.)
    """
    logprobs = token_logprobs(logits, batch["labels"])
    loss = -masked_token_mean(logprobs, batch["loss_mask"])
    reported = loss.detach().clone()
    if parallel_state.get_context_parallel_world_size() > 1:
        torch.distributed.all_reduce(reported, group=parallel_state.get_context_parallel_group())
    return loss, {"loss": reported, "logprobs": logprobs.detach()}


def routing_context(model: nn.Module, batch: MicroBatch) -> contextlib.AbstractContextManager:
    """The micro-batch's routing on ``model``'s MoE routers (``models.routing``): its
    ``routing`` entry -- ``RouteAction.REPLAY``, or a ``Disagreement`` to measure into -- and its
    ``routed_experts`` ``[1, t, L, k]`` (this CP rank's tokens); a no-op without them. Under
    sequence parallelism each TP rank's routers see its contiguous ``1/tp`` of the tokens; a
    pipeline stage's chunk takes its layers' columns. Local (the forward's own collectives
    only); no host read."""
    action = batch.get("routing")
    routers = chunk_routers(unwrap_chunk(model)) if action is not None else []
    if not routers:
        return contextlib.nullcontext()
    routes = batch["routed_experts"][0]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1 and unwrap_chunk(model).config.sequence_parallel:
        rank = parallel_state.get_tensor_model_parallel_rank()
        routes = sequence_parallel_slice(routes, tp, rank)
    first = routers[0].layer
    routes = routes[:, first : first + len(routers)]  # a slice: no index tensor to copy over
    if isinstance(action, Disagreement):
        return measuring(routers, routes, action)
    if action is not RouteAction.REPLAY:
        raise ValueError(f"routing {action!r} is not RouteAction.REPLAY or a Disagreement")
    return replaying(routers, filled(routes))


def _forward_step(loss_fn: LossFn, data_iterator, model: nn.Module):
    batch = next(data_iterator)
    with routing_context(model, batch):
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
    variable_seq_lengths: bool = False,
) -> list[dict[str, Any]]:
    """Forward (and backward unless ``forward_only``) over ``micro_batches``.

    Returns the metrics dict of every micro-batch on the last pipeline stage (empty list on other
    stages). Gradients accumulate into the (DDP) grad buffers; the caller steps the optimizer.
    All micro-batches must share one sequence length when pp > 1, unless
    ``variable_seq_lengths`` (Megatron then sends each activation's shape before it, one extra
    small p2p per transfer; needed for packed micro-batches of different token counts).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    tokens = micro_batches[0]["tokens"]
    iterators = [iter(micro_batches) for _ in model_chunks]
    step_fn = get_forward_backward_func()
    for chunk in model_chunks:
        unwrap_chunk(chunk).config.variable_seq_lengths = variable_seq_lengths
    with torch.set_grad_enabled(not forward_only):
        metrics = step_fn(
            forward_step_func=partial(_forward_step, loss_fn),
            data_iterator=iterators if len(model_chunks) > 1 else iterators[0],
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=len(micro_batches),
            # Megatron divides seq_length by cp for the p2p shapes: pass the global length.
            seq_length=max(b["tokens"].size(1) for b in micro_batches)
            * parallel_state.get_context_parallel_world_size(),
            micro_batch_size=tokens.size(0),
            forward_only=forward_only,
        )
    return list(metrics) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else []
