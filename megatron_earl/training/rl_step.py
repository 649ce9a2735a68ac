"""The RL train step on Megatron, and the forward-only log-prob pass of the experience phase.

    metrics = train_micro_batches(ddp_chunks, optimizer, whole, RLStepConfig(...))  # the loop
    logprobs = micro_batch_logprobs(chunks, whole)                                 # the loop
    metrics = rl_train_step(ddp_chunks, optimizer, samples, RLStepConfig(loss=PolicyLossConfig()))
    logprobs, entropy = forward_logprobs(chunks, samples, max_tokens=8192)

``whole`` are this DP rank's packed micro-batches (``microbatch.thd_micro_batch`` of the
micro-batches the dispatcher planned and delivered, not CP-split); ``samples`` are this DP rank's
samples as per-sample dicts, packed here by the same planner (``microbatch.build_micro_batches``).
``training.microbatch`` describes the fields: ``tokens``, ``labels``, ``loss_mask``,
``advantages`` and optionally ``old_logprobs``, ``ref_logprobs``, ``rollout_logprobs``; they are
whole on every CP/TP/PP rank of the DP replica. A step:

1. checks the input on every rank and agrees on errors (one small all-gather), so bad input raises
   the same ``ValueError`` everywhere instead of hanging a collective; samples with NaN/inf at a
   trainable position are dropped (``on_nonfinite="drop"``, their mask zeroed, counted in
   ``num_nonfinite_samples``) or raise (``"raise"``);
2. takes the thd micro-batches (or packs the samples by the per-rank token budget), computes the
   global loss normaliser (summed over micro-batches, all-reduced over DP) and splits for CP;
3. runs Megatron's forward-backward schedule (PP aware, ``variable_seq_lengths`` under PP) with the
   output layer chunked (``logprobs.head_logprobs``; the entropy gets an autograd graph only when
   ``entropy_coef != 0``, else it is a metric) and the configured loss (picked once per step
   from the registry: ``losses.build_loss``); without ``old_logprobs`` the loss takes the
   forward's own detached log-probs as pi_old (on-policy: ratio 1); the returned loss is scaled by
   ``num_micro_batches * dp`` (docs/rl_losses.md), so gradients are the full-batch gradient;
   Megatron DDP reduces them over DP x CP in ``finalize_model_grads``;
4. skips the optimizer step if any gradient (or the loss) is non-finite (``skipped_step`` = 1),
   else steps Megatron's optimizer (gradient clipping inside, ``OptimConfig.clip_grad``).

Metrics (floats, the same on every rank): loss, pg_loss, kl_loss, entropy (full-batch values);
token-weighted means clip_frac_low/high, dual_clip_frac, approx_kl, ratio_mean, kl_ref,
tis_weight_mean, tis_clip_frac, is_mask_frac, is_weight_mean, logprob_mismatch (mean
|log pi_old - log pi_rollout|, pi_old being ``old_logprobs`` or, without them, this forward's
log-probs before the update; 0 without ``rollout_logprobs``); ratio_min/max, is_weight_min/max;
is_seq_clip_frac, is_seq_mask_frac (fractions of the samples with a trainable token whose
sequence-level behaviour weight was truncated / masked); num_tokens (trainable), num_samples,
num_empty_samples, num_nonfinite_samples, num_micro_batches (max over ranks), grad_norm,
skipped_step, update_ok, tokens_per_s (all tokens of the step / wall time), num_shared_tokens
(tokens a prefix tree did not compute, ``training.prefix_tree``; 0 for whole samples). With
``RLStepConfig.skipped_normaliser`` (samples the caller left out) entropy and kl_loss are means
over the trained samples, loss and pg_loss the whole batch's.

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

from megatron_earl import runtime
from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.parallel.groups import host_group
from megatron_earl.training.logprobs import (
    DEFAULT_CHUNK_SIZE,
    head_logprobs,
    output_hidden_states,
    output_weight,
)
from megatron_earl.training.losses import build_loss, local_normaliser
from megatron_earl.training.microbatch import (
    Sample,
    build_micro_batches,
    check_samples,
    merge_cp,
    num_sample_tokens,
    num_shared_tokens,
    real_tokens,
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
    "is_mask_frac",
    "is_weight_mean",
    "logprob_mismatch",
)
SAMPLE_COUNTS = ("is_seq_clipped", "is_seq_masked")
"""Sample counts (each CP rank a share): summed, then divided by the step's non-empty samples."""
EXTREMES = (("ratio_max", "ratio_min"), ("is_weight_max", "is_weight_min"))
"""(max, min) metric pairs: the max/min over micro-batches with trainable tokens, else 1."""
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
    skipped_normaliser: float = 0.0
    """The share of the global loss normaliser of the step's samples the caller left out (all
    advantages 0 under an advantage-weighted loss: ``orchestration.zero_advantage``), added to
    the step's own, so the kept samples' gradients are what they were with every sample."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}; valid: >= 1"
            )
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size={self.logprob_chunk_size}; valid: >= 1")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}; valid: {NONFINITE_POLICIES}")
        if not self.skipped_normaliser >= 0:
            raise ValueError(f"skipped_normaliser={self.skipped_normaliser}; valid: >= 0")


def agree(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it raised ``ValueError`` on any rank, raise it on all ranks.

    Which ranks call: every rank of the world (one all-gather of a short message, host group)."""
    try:
        value, error = fn(), None
    except ValueError as err:
        value, error = None, f"{type(err).__name__}: {err}"
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=host_group())
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise ValueError(f"rank {rank}{others}: {message}")
    return value


MB_KEYS = ("seq_ids", "position_ids", "packed_seq_params", "sample_index", "routing")
"""Keys of a thd micro-batch that are not sample fields (``routing``: what the forward does with
the ``routed_experts`` field, ``training.schedule.routing_context``)."""


def nonfinite_slots(micro_batch: dict[str, Any]) -> torch.Tensor:
    """Per sample slot of a whole thd micro-batch: True where a float field holds NaN/inf at a
    trainable position (or the loss mask itself is not finite). Padding (mask 0) never counts."""
    mask = micro_batch["loss_mask"]
    trainable = mask != 0
    bad = ~torch.isfinite(mask)
    for key, t in micro_batch.items():
        if key not in MB_KEYS and t.is_floating_point():
            bad |= trainable & ~torch.isfinite(t)
    slots = len(micro_batch["sample_index"])
    hits = torch.zeros(slots, dtype=torch.long, device=mask.device)
    return hits.index_add_(0, micro_batch["seq_ids"].reshape(-1), bad.reshape(-1).long()) > 0


def expert_lockstep(num_micro_batches: int) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank runs ``num_micro_batches``,
    when an expert group spans data-parallel ranks ((tp x cp) % (ep x etp) != 0): every MoE
    layer's token dispatch is a collective of the expert group, once per micro-batch, so a rank
    with fewer micro-batches would leave the others waiting. Nothing to check otherwise.

    Which ranks call: every rank of the world (one all-reduce of two host numbers, host group,
    only when expert groups span data-parallel ranks)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if (tp * cp) % (ep * etp) == 0:
        return
    bounds = torch.tensor([-float(num_micro_batches), float(num_micro_batches)], device="cpu")
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=host_group())  # (-min, max) at once
    low, high = -bounds[0], bounds[1]
    if low.item() != high.item():
        raise ValueError(
            f"expert parallelism (ep {ep} x etp {etp} over tp {tp} x cp {cp}) runs each MoE "
            "layer's token all-to-all on the ranks of an expert group, which span data-parallel "
            "ranks, once per micro-batch: every rank needs the same number of micro-batches, but "
            f"they have between {int(low.item())} and {int(high.item())}; balance the ranks' "
            "samples or the micro-batch token budget"
        )


def _checked(whole: list[dict[str, Any]], config: RLStepConfig):
    """``whole`` with the samples holding NaN/inf at trainable positions masked out (or a
    ``ValueError``, ``on_nonfinite="raise"``), and their number; bad input raises."""
    if not whole:
        raise ValueError("this rank has 0 samples; every DP rank needs at least one sample")
    names = sorted(k for k in whole[0] if k not in MB_KEYS)
    if "advantages" not in names:
        raise ValueError(f"samples need 'advantages' for the policy loss; got {names}")
    if config.loss.kl_coef > 0 and "ref_logprobs" not in names:
        raise ValueError(f"kl_coef={config.loss.kl_coef} needs a ref_logprobs field")
    correction = config.loss.off_policy_correction
    if correction != "none" and "rollout_logprobs" not in names:
        raise ValueError(f"off_policy_correction={correction!r} needs a rollout_logprobs field")
    # read by Python; every micro-batch's flags in one transfer (one sync on a GPU)
    slots = [len(mb["sample_index"]) for mb in whole]
    flags = runtime.to_host(torch.cat([nonfinite_slots(mb) for mb in whole])).split(slots)
    bad = sorted(int(i) for mb, f in zip(whole, flags) for i in mb["sample_index"][f])
    if bad and config.on_nonfinite == "raise":
        raise ValueError(
            f"samples {bad[:8]} ({len(bad)} in all) hold NaN/inf at trainable positions; fix "
            "the producer or use on_nonfinite='drop'"
        )
    out = []
    for mb, f in zip(whole, flags):
        if bool(f.any()):  # drop: nothing of the sample trains, and its NaNs never reach arithmetic
            drop = runtime.to_device(f)[mb["seq_ids"]]
            mb = {**mb, "loss_mask": mb["loss_mask"].masked_fill(drop, 0.0)}
        out.append(mb)
    return out, len(bad)


def _packed(samples: Sequence[Sample], max_tokens: int, cp: int, sp: int) -> list[dict[str, Any]]:
    check_samples(samples)
    if not samples:
        raise ValueError("this rank has 0 samples; every DP rank needs at least one sample")
    return build_micro_batches(samples, max_tokens, cp, sp)


def _sequence_split(chunks: Sequence[nn.Module]) -> int:
    """Ranks splitting the sequence inside the model: tp under sequence parallelism, else 1."""
    config = unwrap_chunk(chunks[0]).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _local_micro_batches(
    whole: Sequence[dict[str, Any]], chunks: Sequence[nn.Module]
) -> list[dict[str, Any]]:
    """This CP rank's share of each whole micro-batch; raises ``ValueError`` (naming the values)
    when a share does not divide by the sequence-parallel size (inputs packed without ``sp``)."""
    cp = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    sp = _sequence_split(chunks)
    local = [split_micro_batch(mb, cp, cp_rank) for mb in whole]
    for i, mb in enumerate(local):
        tokens = mb["tokens"].size(1)
        if tokens % sp:
            raise ValueError(
                f"micro-batch {i} holds {tokens} tokens on this CP rank, not a multiple of "
                f"tp = {sp}: the model runs with sequence parallelism, so pack its inputs with "
                f"thd_micro_batch(..., sp={sp}) (or model_inputs(..., sp={sp}))"
            )
    return local


def _cp_sum(cp_group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=cp_group)
        return total

    return reduce


def _loss_fn(model: nn.Module | None, config: RLStepConfig, normaliser: torch.Tensor, scale: float):
    # the loss is picked once per step; input was checked upfront (agree), not per micro-batch
    policy_loss = build_loss(dataclasses.replace(config.loss, check_finite=False))
    cp = parallel_state.get_context_parallel_world_size()
    seq_reduce = _cp_sum(parallel_state.get_context_parallel_group()) if cp > 1 else None

    # the entropy is a loss term only with a coefficient; else a metric (no autograd graph)
    entropy_mode = "grad" if config.loss.entropy_coef != 0 else "value"

    def loss_fn(hidden: torch.Tensor, batch: dict[str, Any]):
        logprobs, entropy = head_logprobs(
            hidden,
            output_weight(model),
            batch["labels"],
            chunk_size=config.logprob_chunk_size,
            vocab_size=config.vocab_size,
            entropy=entropy_mode,
        )
        loss, metrics = policy_loss(
            logprobs,
            batch["advantages"],
            batch["loss_mask"],
            entropy=entropy,
            normaliser=normaliser,
            seq_ids=batch["seq_ids"],
            seq_sum_reduce=seq_reduce,
            **{k: batch[k] for k in LOSS_INPUTS if k in batch},
        )
        if "rollout_logprobs" in batch:
            metrics["logprob_mismatch"] = logprob_mismatch(
                batch.get("old_logprobs", logprobs.detach()),
                batch["rollout_logprobs"],
                batch["loss_mask"],
            )
        # the schedule scales the loss in place: metrics must not share its storage
        return loss * scale, {k: v.detach().clone() for k, v in metrics.items()}

    return loss_fn


def logprob_mismatch(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Mean |log pi_old - log pi_rollout| over the trainable tokens (float64; 0 without any): the
    rollout/train mismatch of one micro-batch. Local."""
    trainable = loss_mask != 0
    diff = (old_logprobs - rollout_logprobs).abs().double()
    total = torch.where(trainable, diff, 0.0).sum()
    return total / trainable.sum().clamp(min=1)


def _last_chunk(chunks: Sequence[nn.Module]) -> nn.Module | None:
    return chunks[-1] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def _reduce_metrics(per_mb: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Full-batch metrics from the last stage's per-micro-batch metrics, on every rank.

    Which ranks call: every rank of the world (two all-reduces of host metrics on the host world
    group; only TP rank 0 of the last stage contributes, so TP replicas are not double counted)."""
    contributes = bool(per_mb) and parallel_state.get_tensor_model_parallel_rank() == 0
    per_mb = _host_metrics(per_mb) if contributes else []
    summed = ADDITIVE + SAMPLE_COUNTS
    sums = torch.zeros(len(summed) + len(TOKEN_MEANS) + 1, dtype=torch.float64, device="cpu")
    extremes = torch.full((2 * len(EXTREMES),), float("-inf"), dtype=torch.float64, device="cpu")
    if contributes:
        for m in per_mb:
            n = float(m["num_tokens"])
            values = [float(m[k]) if k in m else 0.0 for k in summed]
            values += [float(m[k]) * n if k in m else 0.0 for k in TOKEN_MEANS]
            sums += torch.tensor([*values, n], dtype=torch.float64)
            if n > 0:
                pairs = [v for hi, lo in EXTREMES for v in (float(m[hi]), -float(m[lo]))]
                extremes = torch.maximum(extremes, torch.tensor(pairs, dtype=torch.float64))
    dist.all_reduce(sums, group=host_group())
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=host_group())
    tokens = float(sums[-1])
    out = {k: float(v) for k, v in zip(summed, sums[: len(summed)].tolist())}
    for k, v in zip(TOKEN_MEANS, sums[len(summed) : -1].tolist()):
        out[k] = v / tokens if tokens > 0 else 0.0
    out["num_tokens"] = tokens
    finite = bool(torch.isfinite(extremes).all())
    for i, (hi, lo) in enumerate(EXTREMES):
        out[hi] = float(extremes[2 * i]) if finite else 1.0
        out[lo] = -float(extremes[2 * i + 1]) if finite else 1.0
    return out


def _host_metrics(per_mb: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Every micro-batch's (0-dim, device) metrics as Python floats, read back in one device ->
    host transfer for the step (one sync on a GPU, not one per metric and micro-batch). Local."""
    keys = [(i, k) for i, m in enumerate(per_mb) for k in m]
    values = runtime.to_host(torch.stack([per_mb[i][k].double() for i, k in keys])).tolist()
    out: list[dict[str, float]] = [{} for _ in per_mb]
    for (i, k), v in zip(keys, values, strict=True):
        out[i][k] = v
    return out


def _grads_finite(ddp_chunks: Sequence[nn.Module]) -> bool:
    """Whether every gradient of every rank is finite: one check per Megatron DDP grad buffer
    (every parameter's ``main_grad`` is a view of one; padding stays zero).

    Which ranks call: every rank of the world (one all-reduce of a host flag, host group)."""
    flags = [
        torch.isfinite(buffer.grad_data).all()
        for chunk in ddp_chunks
        for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers)
    ]
    local_ok = bool(torch.stack(flags).all()) if flags else True  # one device sync, not one each
    ok = torch.tensor([1.0 if local_ok else 0.0], device="cpu")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=host_group())
    return bool(ok.item() == 1.0)


def rl_train_step(
    ddp_chunks: list[nn.Module],
    optimizer,
    samples: Sequence[Sample],
    config: RLStepConfig,
) -> dict[str, float]:
    """One policy update on this DP rank's ``samples`` (per-sample dicts, packed here by the
    budget ``config.max_tokens_per_micro_batch``); returns the step's metrics (module doc).

    Which ranks call: every rank of the world; ranks of one DP replica pass the same samples.
    """
    cp = parallel_state.get_context_parallel_world_size()
    sp = _sequence_split(ddp_chunks)
    budget = config.max_tokens_per_micro_batch
    return _train(
        ddp_chunks, optimizer, lambda: _checked(_packed(samples, budget, cp, sp), config), config
    )


def train_micro_batches(
    ddp_chunks: list[nn.Module],
    optimizer,
    whole: Sequence[dict[str, Any]],
    config: RLStepConfig,
) -> dict[str, float]:
    """One policy update on this DP rank's packed micro-batches ``whole`` (thd, not CP-split,
    padded for this layout's cp: ``microbatch.thd_micro_batch``), run as given; returns the
    step's metrics (module doc).

    Which ranks call: every rank of the world; ranks of one DP replica pass the same batches.
    """
    return _train(ddp_chunks, optimizer, lambda: _checked(list(whole), config), config)


def _train(ddp_chunks: list[nn.Module], optimizer, prepare, config: RLStepConfig):
    start = time.perf_counter()
    dp = parallel_state.get_data_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    whole, num_bad = agree(prepare)
    expert_lockstep(len(whole))

    # Global normaliser and counts from the whole (pre-CP-split) micro-batches, summed over DP
    # (host metadata: the host twin of the DP group).
    # The device values of every micro-batch are read back in one transfer (one sync on a GPU).
    counts = torch.zeros(6, dtype=torch.float64, device="cpu")
    local = []  # per micro-batch: its normaliser share, its samples without trainable tokens
    for mb in whole:
        ids = mb["seq_ids"]
        per_sample = torch.zeros(len(mb["sample_index"]), device=ids.device).index_add(
            0, ids.reshape(-1), (mb["loss_mask"] != 0).float().reshape(-1)
        )
        share = local_normaliser(mb["loss_mask"], config.loss.aggregation, ids)
        local += [share, (per_sample == 0).sum().float()]
    local = runtime.to_host(torch.stack(local)).tolist() if local else []
    for i, mb in enumerate(whole):
        counts[0] += local[2 * i]
        counts[1] += len(mb["sample_index"])
        counts[2] += local[2 * i + 1]
        counts[4] += num_sample_tokens(mb)
        counts[5] += num_shared_tokens(mb)
    counts[3] = num_bad
    dp_group = parallel_state.get_data_parallel_group()
    num_mb_max = torch.tensor([float(len(whole))], device="cpu")
    dist.all_reduce(counts, group=host_group(dp_group))
    dist.all_reduce(num_mb_max, op=dist.ReduceOp.MAX, group=host_group())
    trained_normaliser = float(counts[0])
    normaliser = torch.tensor(trained_normaliser + config.skipped_normaliser, dtype=torch.float32)

    micro_batches = _local_micro_batches(whole, ddp_chunks)
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss_fn = _loss_fn(
        _last_chunk(ddp_chunks), config, normaliser, scale=float(len(micro_batches) * dp)
    )
    with output_hidden_states(ddp_chunks):
        per_mb = forward_backward(ddp_chunks, micro_batches, loss_fn, variable_seq_lengths=pp > 1)
    metrics = _reduce_metrics(per_mb)
    if config.skipped_normaliser and trained_normaliser > 0:
        # loss and pg_loss stay the whole batch's (skipped samples add exactly 0); these are
        # means over the trained samples
        for key in ("entropy", "kl_loss"):
            metrics[key] *= float(normaliser) / trained_normaliser
    nonempty = float(counts[1] - counts[2])
    for count, frac in zip(SAMPLE_COUNTS, ("is_seq_clip_frac", "is_seq_mask_frac")):
        metrics[frac] = metrics.pop(count) / nonempty if nonempty > 0 else 0.0

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
        num_shared_tokens=float(counts[5]),
    )
    return metrics


def forward_logprobs(
    chunks: list[nn.Module],
    samples: Sequence[Sample],
    *,
    max_tokens: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_size: int | None = None,
    entropy: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None] | None:
    """Forward-only log-probs (and, with ``entropy``, the entropy) of every sample's ``labels``
    (old/ref log-probs), the samples packed here by the budget ``max_tokens``.

    Returns, on the last pipeline stage, per-sample fp32 tensors [L] in ``samples`` order (whole
    samples: with cp > 1 the CP ranks' local results are all-gathered over the CP group; None in
    place of the entropy list without ``entropy``); None on other stages. Values at positions that
    predict nothing (the last) are computed all the same.
    Which ranks call: every rank of the world, ranks of one DP replica with the same samples.
    """
    cp = parallel_state.get_context_parallel_world_size()
    sp = _sequence_split(chunks)
    whole = agree(lambda: _packed(samples, max_tokens, cp, sp))
    out = _logprobs(chunks, whole, chunk_size, vocab_size, entropy)
    if out is None:
        return None
    per_sample: dict[str, list[torch.Tensor | None]] = {}
    for key, merged in out.items():
        per_sample[key] = [None] * len(samples)
        for mb, values in zip(whole, merged, strict=True):
            pieces = unpack_per_sample(values, mb)
            for i, piece in zip(mb["sample_index"].tolist(), pieces, strict=True):
                per_sample[key][i] = piece.clone()
    return per_sample["logprobs"], per_sample.get("entropy")


def micro_batch_logprobs(
    chunks: list[nn.Module],
    whole: Sequence[dict[str, Any]],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_size: int | None = None,
) -> list[torch.Tensor] | None:
    """Forward-only log-probs of the ``labels`` of packed micro-batches ``whole`` (thd, not
    CP-split: ``microbatch.thd_micro_batch``), run as given; no entropy (the old/ref log-prob
    passes of the loop discard it).

    Returns, on the last pipeline stage, one fp32 tensor ``[sum(lengths)]`` per micro-batch:
    its real tokens in packed order (a per-token field of the dispatched micro-batch; with cp > 1
    all-gathered over the CP group); None on other stages.
    Which ranks call: every rank of the world, ranks of one DP replica with the same batches.
    """
    whole = agree(lambda: _nonempty(whole))
    out = _logprobs(chunks, whole, chunk_size, vocab_size, entropy=False)
    if out is None:
        return None
    return [real_tokens(v, mb) for mb, v in zip(whole, out["logprobs"], strict=True)]


def _nonempty(whole: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if not whole:
        raise ValueError("this rank has 0 samples; every DP rank needs at least one sample")
    return list(whole)


def _logprobs(
    chunks: list[nn.Module],
    whole: list[dict[str, Any]],
    chunk_size: int,
    vocab_size: int | None,
    entropy: bool,
) -> dict[str, list[torch.Tensor]] | None:
    """Log-probs (and with ``entropy`` the entropy) of every whole micro-batch, ``[1, t]``
    merged over CP, keyed "logprobs" / "entropy", on the last stage; None elsewhere.
    Which ranks call: every rank of the world."""
    cp = parallel_state.get_context_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    model = _last_chunk(chunks)

    def loss_fn(hidden: torch.Tensor, batch: dict[str, Any]):
        lp, ent = head_logprobs(
            hidden,
            output_weight(model),
            batch["labels"],
            chunk_size=chunk_size,
            vocab_size=vocab_size,
            entropy="value" if entropy else "none",
        )
        values = {"logprobs": lp} if ent is None else {"logprobs": lp, "entropy": ent}
        return hidden.new_zeros(()), values

    expert_lockstep(len(whole))
    micro_batches = _local_micro_batches(whole, chunks)
    with output_hidden_states(chunks), torch.no_grad():
        per_mb = forward_backward(
            chunks, micro_batches, loss_fn, forward_only=True, variable_seq_lengths=pp > 1
        )
    if model is None:
        return None
    out: dict[str, list[torch.Tensor]] = {}
    for mb, metrics in zip(whole, per_mb, strict=True):
        for key, local in metrics.items():
            shards = [local]
            if cp > 1:
                shards = [torch.empty_like(local) for _ in range(cp)]
                dist.all_gather(shards, local, group=parallel_state.get_context_parallel_group())
            out.setdefault(key, []).append(merge_cp(shards, mb))
    return out
