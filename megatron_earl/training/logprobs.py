"""Per-token log-probs and entropy of target tokens, computed from the final hidden states with the
output layer chunked over tokens, so full-vocab fp32 logits never exist for a whole packed row.

    with output_hidden_states(chunks):            # the model now returns final hidden states
        hidden = model(tokens, position_ids, None, packed_seq_params=...)      # [b, s, h]
    logprobs, entropy = head_logprobs(hidden, output_weight(model), labels, chunk_size=1024)
    logprobs, _ = head_logprobs(hidden, weight, labels, entropy="none")   # forward-only passes

``head_logprobs`` is one autograd Function: the forward walks token chunks of ``chunk_size``,
computes that chunk's vocab-parallel logits ``[c, V/tp]`` in fp32, reduces max and sums over the
TP group and keeps only two floats per token (log-sum-exp and entropy); the backward recomputes
each chunk's logits and accumulates the hidden-state and weight gradients chunk by chunk. Peak
extra memory is a few ``chunk_size x V/tp`` fp32 buffers, whatever the sequence length; the result
equals the unchunked one (``schedule.token_logprobs``) up to float rounding.

The entropy costs elementwise passes over each chunk's logits: one in the forward, three in the
backward. ``entropy="value"`` (entropy only as a metric) skips the backward ones,
``entropy="none"`` (the forward-only old/ref log-prob passes) all of them. The log-probs are the
same in every mode, and so are the gradients of a loss that does not use the entropy.

Parallelism. TP: the weight is this rank's vocab shard (rows ``[tp_rank * V/tp, ...)``), max and
sums are all-reduced over the TP group in the forward only (the backward needs no collective;
the hidden-state gradient is all-reduced by Megatron's ``copy_to_tensor_model_parallel_region``,
as in ``ColumnParallelLinear``). CP: each rank computes its own tokens; results are per local
token. PP: only the last stage holds the output layer and calls this.

Padded vocabulary: Megatron pads the output layer to ``padded_vocab_size``; pass ``vocab_size`` to
exclude the padding rows from the softmax (what an engine sampling over the real vocabulary does).
None keeps every row, like Megatron's own cross entropy.

Legend: n = tokens (flattened), h = hidden, Vl = vocabulary rows on this TP rank, c = chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch import nn

from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.patches import output_layer_passthrough

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per output-layer chunk: 1024 x 32K vocab fp32 = 128 MiB per logits buffer."""
ENTROPY_MODES = ("grad", "value", "none")
"""What ``head_logprobs`` returns as entropy: differentiable, a detached value, or nothing."""


def output_weight(model: nn.Module) -> torch.Tensor:
    """The output-layer weight ``[V/tp, h]`` of a last-stage GPTModel chunk (tied or not)."""
    model = unwrap_chunk(model)
    if getattr(model, "output_layer", None) is None:
        raise ValueError("output_weight needs a last-pipeline-stage chunk (post_process=True)")
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def output_hidden_states(chunks: Sequence[nn.Module]) -> contextlib.AbstractContextManager:
    """While active, last-stage chunks return final hidden states ``[b, s, h]`` instead of logits.

    The output layer's forward is swapped on the instance (the patch
    ``patches/output_layer_passthrough.py``; its parameters stay where they are, so DDP and the
    optimizer see no change) and restored on exit; compute logits with ``head_logprobs`` and
    ``output_weight``.
    """
    layers = [
        m.output_layer
        for m in map(unwrap_chunk, chunks)
        if getattr(m, "post_process", False) and getattr(m, "output_layer", None) is not None
    ]
    return output_layer_passthrough.passthrough(layers)


class _ChunkedHead(torch.autograd.Function):
    """hidden [n, h] (TP-replicated), weight [Vl, h] -> log p(target) [n], entropy [n] (fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, vocab_start, num_valid, group, entropy):
        n = hidden.size(0)
        w = weight[:num_valid]
        with_entropy = entropy != "none"
        lse = hidden.new_empty(n, dtype=torch.float32)
        target_logit = torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        local = targets - vocab_start
        owned = (local >= 0) & (local < num_valid)
        local = local.clamp(0, max(num_valid - 1, 0))
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            z = (hidden[a:b] @ w.t()).float()  # [c, Vl]
            if num_valid:
                m = z.amax(dim=1)
            else:
                m = z.new_full((b - a,), float("-inf"))
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            z -= m[:, None]
            picked = z.gather(1, local[a:b, None]).squeeze(1) if num_valid else m.new_zeros(b - a)
            e = torch.exp(z)
            sums = [e.sum(1)]
            if with_entropy:
                sums.append(e.mul_(z).sum(1))
            stats = torch.stack([*sums, torch.where(owned[a:b], picked, 0.0)])
            del e, z
            if group is not None:
                dist.all_reduce(stats, group=group)
            sum_exp, picked = stats[0], stats[-1]
            log_z = torch.log(sum_exp)
            lse[a:b] = m + log_z
            target_logit[a:b] = picked + m
            if with_entropy:
                ent[a:b] = log_z - stats[1] / sum_exp
        ctx.save_for_backward(hidden, weight, local, owned, lse, ent)
        ctx.chunk_size, ctx.num_valid = chunk_size, num_valid
        # unused or non-differentiable outputs get None gradients, so the backward skips them
        ctx.set_materialize_grads(False)
        if entropy != "grad":
            ctx.mark_non_differentiable(ent)
        return target_logit - lse, ent

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, local, owned, lse, entropy = ctx.saved_tensors
        chunk_size, num_valid = ctx.chunk_size, ctx.num_valid
        w = weight[:num_valid]
        grad_hidden = torch.zeros_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        n = hidden.size(0)
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            h = hidden[a:b]
            log_p = (h @ w.t()).float()  # [c, Vl]; two such buffers live at a time
            log_p -= lse[a:b, None]
            g = torch.exp(log_p)  # p, turned into the gradient in place
            if grad_entropy is not None:  # dH / dz_j = -p_j (log p_j + H)
                log_p += entropy[a:b, None]
                log_p.mul_(g).mul_(grad_entropy[a:b, None])
            if grad_logprob is not None:  # d log p_t / dz = onehot(t) - p
                gl = grad_logprob[a:b]
                g.mul_(-gl[:, None])
                g.scatter_add_(1, local[a:b, None], torch.where(owned[a:b], gl, 0.0)[:, None])
            else:
                g.zero_()
            if grad_entropy is not None:
                g -= log_p
            del log_p
            g = g.to(hidden.dtype)
            grad_hidden[a:b] = g @ w
            grad_w[:num_valid] += (g.t() @ h).float()
            del g
        return grad_hidden, grad_w.to(weight.dtype), None, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    entropy: str = "grad",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and the policy entropy per token, from final hidden states.

    hidden: ``[..., h]`` (after the final norm, replicated over TP); weight: this rank's output
    shard ``[V/tp, h]`` (``output_weight``); targets: ``[...]`` global token ids. Returns two fp32
    tensors shaped like ``targets``; the log-probs are differentiable w.r.t. ``hidden`` and
    ``weight``. ``chunk_size`` bounds the tokens whose logits exist at once; ``vocab_size``
    excludes padded vocabulary rows. ``tp_group`` defaults to Megatron's TP group.
    ``entropy`` (``ENTROPY_MODES``): "grad" returns a differentiable entropy (a loss term),
    "value" its value without autograd graph (a metric: the backward skips its terms), "none"
    does not compute it (returns None; saves one pass over each chunk's logits). The log-probs
    are the same in every mode.

    Which ranks call: every rank of the TP group (all-reduces in the forward), same ``n``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}; valid: >= 1 tokens")
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy={entropy!r}; valid: {ENTROPY_MODES}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree; hidden "
            "must be targets.shape + (hidden_size,)"
        )
    if hidden.size(-1) != weight.size(1):
        raise ValueError(f"hidden size {hidden.size(-1)} != output weight {tuple(weight.shape)}")
    if tp_group is None and parallel_state.model_parallel_is_initialized():
        tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = tp_group.size() if tp_group is not None else 1
    tp_rank = tp_group.rank() if tp_group is not None else 0
    rows = weight.size(0)
    padded = rows * tp
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size}; valid: 1..{padded} (output rows x tp)")
    if targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"targets hold ids in [{lo}, {hi}]; valid: [0, {vocab_size}) (use a valid id such "
                "as 0 at positions the loss mask excludes)"
            )
    vocab_start = tp_rank * rows
    num_valid = max(0, min(rows, vocab_size - vocab_start))
    flat = hidden.reshape(-1, hidden.size(-1))
    if tp > 1:  # identity forward, all-reduce of the hidden-state gradient over TP in backward
        flat = tensor_parallel.copy_to_tensor_model_parallel_region(flat, group=tp_group)
    logprob, ent = _ChunkedHead.apply(
        flat,
        weight,
        targets.reshape(-1).long(),
        chunk_size,
        vocab_start,
        num_valid,
        tp_group if tp > 1 else None,
        entropy,
    )
    return logprob.view(targets.shape), None if entropy == "none" else ent.view(targets.shape)


def logits_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unchunked reference: log-probs and entropy from materialised vocab-parallel logits
    ``[..., V/tp]`` (tests and small batches). Which ranks call: every rank of the TP group."""
    if tp_group is None and parallel_state.model_parallel_is_initialized():
        tp_group = parallel_state.get_tensor_model_parallel_group()
    z = logits.float()
    m = z.detach().amax(-1)
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    z = z - m[..., None]
    e = torch.exp(z)
    rows = z.size(-1)
    start = tp_group.rank() * rows if tp_group is not None else 0
    local = targets.long() - start
    owned = (local >= 0) & (local < rows)
    picked = z.gather(-1, local.clamp(0, rows - 1)[..., None]).squeeze(-1)
    stats = torch.stack([e.sum(-1), (e * z).sum(-1), torch.where(owned, picked, 0.0)])
    if tp_group is not None and tp_group.size() > 1:
        stats = tensor_parallel.reduce_from_tensor_model_parallel_region(stats, group=tp_group)
    sum_exp, sum_ez, picked = stats.unbind(0)
    log_z = torch.log(sum_exp)
    return picked - log_z, log_z - sum_ez / sum_exp
