"""The RL train step on Megatron, and the forward-only log-prob pass of the experience phase.

    metrics = rl_train_step(ddp_chunks, optimizer, samples, RLStepConfig(loss=PolicyLossConfig()))
    logprobs, entropy = forward_logprobs(chunks, samples, max_tokens=8192)

``samples`` are this DP rank's samples (``training.microbatch`` describes the fields: ``tokens``,
``labels``, ``loss_mask``, ``advantages`` and optionally ``old_logprobs``, ``ref_logprobs``,
``rollout_logprobs``), whole on every CP/TP/PP rank of the DP replica. A step:

1. checks the input on every rank and agrees on errors (one small all-gather), so bad input raises
   the same ``ValueError`` everywhere instead of hanging a collective; samples with NaN/inf at a
   trainable position are dropped (``on_nonfinite="drop"``, their mask zeroed, counted in
   ``num_nonfinite_samples``) or raise (``"raise"``);
2. packs them into thd micro-batches by the per-rank token budget (``microbatch``), computes the
   global loss normaliser (summed over micro-batches, all-reduced over DP) and splits for CP;
3. runs Megatron's forward-backward schedule (PP aware, ``variable_seq_lengths`` under PP) with the
   output layer chunked (``logprobs.head_logprobs``) and ``losses.policy_loss``; the returned loss
   is scaled by ``num_micro_batches * dp`` (docs/rl_losses.md), so gradients are the full-batch
   gradient; Megatron DDP reduces them over DP x CP in ``finalize_model_grads``;
4. skips the optimizer step if any gradient (or the loss) is non-finite (``skipped_step`` = 1),
   else steps Megatron's optimizer (gradient clipping inside, ``OptimConfig.clip_grad``).

Metrics (floats, the same on every rank): loss, pg_loss, kl_loss, entropy (full-batch values);
token-weighted means clip_frac_low/high, dual_clip_frac, approx_kl, ratio_mean, kl_ref,
tis_weight_mean, tis_clip_frac; ratio_min/max; num_tokens (trainable), num_samples,
num_empty_samples, num_nonfinite_samples, num_micro_batches (max over ranks), grad_norm,
skipped_step, update_ok, tokens_per_s (all tokens of the step / wall time).

Which ranks call: every rank of the world, each with its DP rank's samples.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.training.logprobs import (
    DEFAULT_CHUNK_SIZE,
    head_logprobs,
    output_hidden_states,
    output_weight,
)
from megatron_earl.training.losses import local_normaliser, policy_loss
from megatron_earl.training.microbatch import (
    Sample,
    build_micro_batches,
    check_samples,
    merge_cp,
    split_micro_batch,
    unpack_per_sample,
)
from megatron_earl.training.schedule import forward_backward

LOSS_INPUTS = ("old_logprobs", "rollout_logprobs", "ref_logprobs")
ADDITIVE = ("loss", "pg_loss", "kl_loss", "entropy")
TOKEN_MEANS = (
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "approx_kl",
    "ratio_mean",
    "kl_ref",
    "tis_weight_mean",
    "tis_clip_frac",
)
NONFINITE_POLICIES = ("drop", "raise")


@dataclass(frozen=True)
class RLStepConfig:
    """How one RL train step runs."""

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss (type, clipping, KL, entropy, aggregation; see docs/rl_losses.md)."""
    max_tokens_per_micro_batch: int = 8192
    """Per-rank token budget of one micro-batch (tokens a rank holds: padded length / cp)."""
    logprob_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per output-layer chunk in the log-prob pass (bounds the logits memory)."""
    vocab_size: int | None = None
    """Real vocabulary size: padded output rows beyond it are excluded from the softmax."""
    on_nonfinite: str = "drop"
    """Samples with NaN/inf at a trainable position: "drop" (mask them, count them) or "raise"."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}; valid: >= 1"
            )
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size={self.logprob_chunk_size}; valid: >= 1")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}; valid: {NONFINITE_POLICIES}")


def agree(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it raised ``ValueError`` on any rank, raise it on all ranks.

    Which ranks call: every rank of the world (one all-gather of a short message)."""
    try:
        value, error = fn(), None
    except ValueError as err:
        value, error = None, f"{type(err).__name__}: {err}"
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise ValueError(f"rank {rank}{others}: {message}")
    return value


def nonfinite_samples(samples: Sequence[Sample]) -> list[int]:
    """Indices of samples with NaN/inf in a float field at a trainable position."""
    bad = []
    for i, s in enumerate(samples):
        trainable = s["loss_mask"] != 0
        if not bool(torch.isfinite(s["loss_mask"]).all()):
            bad.append(i)
            continue
        for t in s.values():
            if t.is_floating_point() and bool((trainable & ~torch.isfinite(t)).any()):
                bad.append(i)
                break
    return bad


def _prepare(samples: Sequence[Sample], config: RLStepConfig, cp: int):
    check_samples(samples)
    if not samples:
        raise ValueError("this rank has 0 samples; every DP rank needs at least one sample")
    if "advantages" not in samples[0]:
        raise ValueError(f"samples need 'advantages' for the policy loss; got {sorted(samples[0])}")
    if config.loss.kl_coef > 0 and "ref_logprobs" not in samples[0]:
        raise ValueError(f"kl_coef={config.loss.kl_coef} needs a ref_logprobs field")
    if config.loss.tis_cap is not None and "rollout_logprobs" not in samples[0]:
        raise ValueError(f"tis_cap={config.loss.tis_cap} needs a rollout_logprobs field")
    bad = nonfinite_samples(samples)
    if bad and config.on_nonfinite == "raise":
        raise ValueError(
            f"samples {bad[:8]} ({len(bad)} in all) hold NaN/inf at trainable positions; fix "
            "the producer or use on_nonfinite='drop'"
        )
    samples = list(samples)
    for i in bad:  # drop: nothing of the sample trains, and its NaNs never reach arithmetic
        samples[i] = {**samples[i], "loss_mask": torch.zeros_like(samples[i]["loss_mask"])}
    whole = build_micro_batches(samples, config.max_tokens_per_micro_batch, cp)
    return whole, len(bad)


def _cp_sum(cp_group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=cp_group)
        return total

    return reduce


def _loss_fn(model: nn.Module | None, config: RLStepConfig, normaliser: torch.Tensor, scale: float):
    loss_config = dataclasses.replace(config.loss, check_finite=False)  # input checked upfront
    cp = parallel_state.get_context_parallel_world_size()
    seq_reduce = _cp_sum(parallel_state.get_context_parallel_group()) if cp > 1 else None

    def loss_fn(hidden: torch.Tensor, batch: dict[str, Any]):
        logprobs, entropy = head_logprobs(
            hidden,
            output_weight(model),
            batch["labels"],
            chunk_size=config.logprob_chunk_size,
            vocab_size=config.vocab_size,
        )
        loss, metrics = policy_loss(
            loss_config,
            logprobs,
            batch["advantages"],
            batch["loss_mask"],
            entropy=entropy,
            normaliser=normaliser,
            seq_ids=batch["seq_ids"],
            seq_sum_reduce=seq_reduce,
            **{k: batch[k] for k in LOSS_INPUTS if k in batch},
        )
        # the schedule scales the loss in place: metrics must not share its storage
        return loss * scale, {k: v.detach().clone() for k, v in metrics.items()}

    return loss_fn


def _last_chunk(chunks: Sequence[nn.Module]) -> nn.Module | None:
    return chunks[-1] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def _reduce_metrics(per_mb: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Full-batch metrics from the last stage's per-micro-batch metrics, on every rank.

    Which ranks call: every rank of the world (two all-reduces; only TP rank 0 of the last stage
    contributes, so TP replicas are not double counted)."""
    contributes = bool(per_mb) and parallel_state.get_tensor_model_parallel_rank() == 0
    sums = torch.zeros(len(ADDITIVE) + len(TOKEN_MEANS) + 1, dtype=torch.float64)
    extremes = torch.full((2,), float("-inf"), dtype=torch.float64)
    if contributes:
        for m in per_mb:
            n = float(m["num_tokens"])
            values = [float(m[k]) if k in m else 0.0 for k in ADDITIVE]
            values += [float(m[k]) * n if k in m else 0.0 for k in TOKEN_MEANS]
            sums += torch.tensor([*values, n], dtype=torch.float64)
            if n > 0:
                extremes = torch.maximum(
                    extremes, torch.tensor([float(m["ratio_max"]), -float(m["ratio_min"])])
                )
    dist.all_reduce(sums)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    tokens = float(sums[-1])
    out = {k: float(v) for k, v in zip(ADDITIVE, sums[: len(ADDITIVE)].tolist())}
    for k, v in zip(TOKEN_MEANS, sums[len(ADDITIVE) : -1].tolist()):
        out[k] = v / tokens if tokens > 0 else 0.0
    out["num_tokens"] = tokens
    finite = bool(torch.isfinite(extremes).all())
    out["ratio_max"] = float(extremes[0]) if finite else 1.0
    out["ratio_min"] = -float(extremes[1]) if finite else 1.0
    return out


def _grads_finite(ddp_chunks: Sequence[nn.Module]) -> bool:
    """Which ranks call: every rank of the world (one all-reduce)."""
    flags = [
        torch.isfinite(p.main_grad).all()
        for chunk in ddp_chunks
        for p in chunk.parameters()
        if p.requires_grad and getattr(p, "main_grad", None) is not None
    ]
    local_ok = bool(torch.stack(flags).all()) if flags else True  # one device sync, not one each
    ok = torch.tensor([1.0 if local_ok else 0.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() == 1.0)


def rl_train_step(
    ddp_chunks: list[nn.Module],
    optimizer,
    samples: Sequence[Sample],
    config: RLStepConfig,
) -> dict[str, float]:
    """One policy update on this DP rank's ``samples``; returns the step's metrics (module doc).

    Which ranks call: every rank of the world; ranks of one DP replica pass the same samples.
    """
    start = time.perf_counter()
    dp = parallel_state.get_data_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    whole, num_bad = agree(lambda: _prepare(samples, config, cp))

    # Global normaliser and counts from the whole (pre-CP-split) micro-batches, summed over DP.
    counts = torch.zeros(5, dtype=torch.float64)
    for mb in whole:
        ids = mb["seq_ids"]
        counts[0] += float(local_normaliser(mb["loss_mask"], config.loss.aggregation, ids))
        per_sample = torch.zeros(len(mb["sample_index"])).index_add(
            0, ids.reshape(-1), (mb["loss_mask"] != 0).float().reshape(-1)
        )
        counts[1] += len(per_sample)
        counts[2] += float((per_sample == 0).sum())
        counts[4] += float(mb["packed_seq_params"].cu_seqlens_q[-1])
    counts[3] = num_bad
    dp_group = parallel_state.get_data_parallel_group()
    num_mb_max = torch.tensor([float(len(whole))])
    dist.all_reduce(counts, group=dp_group)
    dist.all_reduce(num_mb_max, op=dist.ReduceOp.MAX)
    normaliser = counts[0].float()

    micro_batches = [split_micro_batch(mb, cp, cp_rank) for mb in whole]
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss_fn = _loss_fn(
        _last_chunk(ddp_chunks), config, normaliser, scale=float(len(micro_batches) * dp)
    )
    with output_hidden_states(ddp_chunks):
        per_mb = forward_backward(ddp_chunks, micro_batches, loss_fn, variable_seq_lengths=pp > 1)
    metrics = _reduce_metrics(per_mb)

    finite = _grads_finite(ddp_chunks) and math.isfinite(metrics["loss"])
    if finite:
        update_ok, grad_norm, _ = optimizer.step()
    else:  # never apply a NaN/inf update: skip, report, and leave the grads to the next zeroing
        update_ok, grad_norm = False, float("nan")
    metrics.update(
        num_samples=float(counts[1]),
        num_empty_samples=float(counts[2]),
        num_nonfinite_samples=float(counts[3]),
        num_micro_batches=float(num_mb_max),
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        skipped_step=0.0 if finite else 1.0,
        update_ok=float(bool(update_ok)),
        tokens_per_s=float(counts[4]) / max(time.perf_counter() - start, 1e-9),
    )
    return metrics


def forward_logprobs(
    chunks: list[nn.Module],
    samples: Sequence[Sample],
    *,
    max_tokens: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_size: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Forward-only log-probs and entropy of every sample's ``labels`` (old/ref log-probs).

    Returns, on the last pipeline stage, per-sample fp32 tensors [L] in ``samples`` order (whole
    samples: with cp > 1 the CP ranks' local results are all-gathered over the CP group); None on
    other stages. Values at positions that predict nothing (the last) are computed all the same.
    Which ranks call: every rank of the world, ranks of one DP replica with the same samples.
    """
    cp = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    whole = agree(lambda: _forward_inputs(samples, max_tokens, cp))
    model = _last_chunk(chunks)

    def loss_fn(hidden: torch.Tensor, batch: dict[str, Any]):
        lp, ent = head_logprobs(
            hidden,
            output_weight(model),
            batch["labels"],
            chunk_size=chunk_size,
            vocab_size=vocab_size,
        )
        return hidden.new_zeros(()), {"logprobs": lp.detach(), "entropy": ent.detach()}

    micro_batches = [split_micro_batch(mb, cp, cp_rank) for mb in whole]
    with output_hidden_states(chunks), torch.no_grad():
        per_mb = forward_backward(
            chunks, micro_batches, loss_fn, forward_only=True, variable_seq_lengths=pp > 1
        )
    if model is None:
        return None
    out: dict[str, list[torch.Tensor | None]] = {k: [None] * len(samples) for k in per_mb[0]}
    for mb, metrics in zip(whole, per_mb, strict=True):
        for key, local in metrics.items():
            shards = [local]
            if cp > 1:
                shards = [torch.empty_like(local) for _ in range(cp)]
                dist.all_gather(shards, local, group=parallel_state.get_context_parallel_group())
            pieces = unpack_per_sample(merge_cp(shards, mb), mb)
            for i, piece in zip(mb["sample_index"].tolist(), pieces, strict=True):
                out[key][i] = piece.clone()
    return out["logprobs"], out["entropy"]


def _forward_inputs(samples: Sequence[Sample], max_tokens: int, cp: int):
    if not samples:
        raise ValueError("this rank has 0 samples; every DP rank needs at least one sample")
    return build_micro_batches(samples, max_tokens, cp)
