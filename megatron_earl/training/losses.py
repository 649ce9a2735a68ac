"""RL policy losses: clipped PPO (asymmetric + dual clip), GSPO, KL to a reference, entropy bonus,
truncated importance sampling (TIS), and loss aggregation that stays exact across micro-batches.

Pure torch, no process groups: the train step calls ``policy_loss`` on the last pipeline stage with
per-token log-probs of the sampled tokens (``schedule.token_logprobs``). The maths, the handling of
bad input and the micro-batch normaliser contract are written out in ``docs/rl_losses.md``.

Shapes (legend): per-token tensors are ``[B, T]`` (B rows, T positions), all the same shape as
``loss_mask``; a non-zero ``loss_mask`` marks a trainable (model-generated) token. Samples are
the rows unless ``seq_ids`` ``[B, T]`` (int, ``-1`` = no sample) says which sample each token of
a packed row belongs to; S is the number of samples.

Normaliser contract: ``policy_loss`` returns ``sum(per-token or per-sample terms) / normaliser``.
Pass the *global* normaliser (over every micro-batch of the step and every DP rank, see
``local_normaliser``) and the sum of the returned losses over micro-batches and DP ranks equals
the full-batch loss (CP ranks included: each holds a part of the sums). Megatron's schedule
(megatron-core 0.16, 2-tuple loss_func) multiplies each micro-batch loss by cp and divides it by
the number of micro-batches, and its DDP averages gradients over dp*cp ranks; a train step that
wants the full-batch gradient therefore returns ``loss * num_micro_batches * dp``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_earl.config.loss import AGGREGATIONS, KL_ESTIMATORS, PolicyLossConfig

LOG_RATIO_CLAMP = 20.0
"""|log ratio| is clamped to this before exp() so exp never overflows (exp(20) ~ 4.9e8)."""

SampleReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums detached per-sample partial sums [S, k] over the ranks that hold parts of the same samples
(the CP group); identity when every sample is whole on this rank."""


@dataclass(frozen=True)
class SampleIndex:
    """Which sample each token belongs to, flattened: ``index[n]`` in [0, S) or -1 (no sample)."""

    index: torch.Tensor
    """[B*T] int64 sample id per flattened token; -1 for tokens outside every sample."""
    num_samples: int
    """S."""

    @classmethod
    def build(
        cls,
        loss_mask: torch.Tensor,
        seq_ids: torch.Tensor | None = None,
        num_samples: int | None = None,
    ) -> SampleIndex:
        """Rows are samples when ``seq_ids`` is None; else ids from ``seq_ids`` (S = max id + 1
        unless ``num_samples`` is given, e.g. to include samples with no tokens here)."""
        if loss_mask.dim() != 2:
            raise ValueError(f"loss_mask must be [B, T]; got shape {tuple(loss_mask.shape)}")
        rows, cols = loss_mask.shape
        if seq_ids is None:
            index = torch.arange(rows, device=loss_mask.device).repeat_interleave(cols)
            found = rows
        else:
            if seq_ids.shape != loss_mask.shape or seq_ids.is_floating_point():
                raise ValueError(
                    f"seq_ids must be an integer tensor shaped like loss_mask "
                    f"{tuple(loss_mask.shape)}; got {seq_ids.dtype} {tuple(seq_ids.shape)}"
                )
            index = seq_ids.reshape(-1).long()
            found = int(index.max()) + 1 if index.numel() else 0
            if index.numel() and int(index.min()) < -1:
                raise ValueError(f"seq_ids must be >= -1; got min {int(index.min())}")
        if num_samples is None:
            num_samples = found
        elif found > num_samples:
            raise ValueError(f"seq_ids name sample {found - 1} but num_samples={num_samples}")
        return cls(index, num_samples)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sample sums [S, ...] of per-token ``values`` [B, T, ...] (id -1 tokens dropped)."""
        flat = values.reshape(self.index.numel(), *values.shape[2:])
        keep = (self.index >= 0).reshape(-1, *[1] * (flat.dim() - 1))
        flat = torch.where(keep, flat, flat.new_zeros(()))  # no boolean indexing: no device sync
        out = flat.new_zeros(self.num_samples, *values.shape[2:])
        return out.index_add(0, self.index.clamp(min=0), flat)

    def gather(self, per_sample: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Per-token [B, T] view of ``per_sample`` [S] (0 on tokens outside every sample)."""
        safe = self.index.clamp(min=0)
        out = torch.where(self.index >= 0, per_sample[safe], per_sample.new_zeros(()))
        return out.reshape(like.shape)


def check_finite(named: dict[str, torch.Tensor | None], loss_mask: torch.Tensor) -> None:
    """Raise ValueError naming the first tensor of ``named`` that holds NaN/inf at a trainable
    position (masked positions may hold anything). One device sync when all are finite."""
    trainable = loss_mask != 0
    present = {k: v for k, v in named.items() if v is not None}
    bad = {k: trainable & ~torch.isfinite(v) for k, v in present.items()}
    if not bad or not bool(torch.stack([b.any() for b in bad.values()]).any()):
        return
    for name, flags in bad.items():
        if bool(flags.any()):
            where = flags.nonzero()[:4].tolist()
            raise ValueError(
                f"{name} has {int(flags.sum())} non-finite value(s) at trainable positions "
                f"(first [row, col]: {where}); fix the producer or set loss_mask to 0 there"
            )


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    With r = log pi - log pi_ref: k1 = r; k2 = r^2 / 2; k3 = exp(-r) - 1 + r (>= 0, low variance).
    """
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator {estimator!r}; valid: {KL_ESTIMATORS}")


def kl_reward_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """KL as a reward penalty: per-token rewards ``-coef * kl`` [B, T], detached, 0 off the mask.

    Pass them as ``token_rewards`` to an advantage estimator (outcome estimators add each
    sample's sum to its reward; REINFORCE++ keeps them per token).
    """
    trainable = loss_mask != 0
    check_finite({"logprobs": logprobs, "ref_logprobs": ref_logprobs}, loss_mask)
    zero = logprobs.new_zeros(())
    kl = kl_estimate(
        torch.where(trainable, logprobs, zero),
        torch.where(trainable, ref_logprobs, zero),
        estimator,
    )
    return torch.where(trainable, -coef * kl, zero).detach().float()


def local_normaliser(
    loss_mask: torch.Tensor, aggregation: str, seq_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """This micro-batch's share of the normaliser: trainable tokens (token_mean) or samples with at
    least one trainable token (seq modes). Sum it over the step's micro-batches and all-reduce it
    over DP to get the global normaliser. Under CP a sample is split across ranks, so count samples
    from the pre-split batch instead."""
    trainable = (loss_mask != 0).float()
    if aggregation == "token_mean":
        return trainable.sum()
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; valid: {AGGREGATIONS}")
    return (SampleIndex.build(loss_mask, seq_ids).sum(trainable) > 0).float().sum()


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: str,
    samples: SampleIndex,
    *,
    normaliser: float | torch.Tensor | None = None,
    sample_token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` [B, T] over trainable tokens to a scalar.

    token_mean: sum_t v_t / normaliser (default: local trainable tokens).
    seq_mean_token_mean: sum_i (sum_{t in i} v_t / n_i) / normaliser (default: local non-empty
    samples); n_i = ``sample_token_counts`` (global per-sample counts under CP) else local counts.
    seq_mean_token_sum: sum_i sum_{t in i} v_t / normaliser (default: local non-empty samples).
    Samples with n_i = 0 add 0. A normaliser of 0 (nothing trainable anywhere) gives 0.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; valid: {AGGREGATIONS}")
    trainable = loss_mask != 0
    masked = torch.where(trainable, values, values.new_zeros(()))
    if sample_token_counts is None:
        sample_token_counts = samples.sum(trainable.to(values.dtype))
    if normaliser is None:
        if aggregation == "token_mean":
            normaliser = trainable.sum()
        else:
            normaliser = (sample_token_counts > 0).sum()
    normaliser = torch.as_tensor(normaliser, dtype=values.dtype, device=values.device)
    normaliser = normaliser.clamp(min=torch.finfo(values.dtype).tiny)
    if aggregation != "seq_mean_token_mean":
        return masked.sum() / normaliser
    per_sample = samples.sum(masked) / sample_token_counts.to(values.dtype).clamp(min=1)
    return per_sample.sum() / normaliser


def _masked_mean(
    values: torch.Tensor, trainable: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    return torch.where(trainable, values, values.new_zeros(())).sum().detach() / count.clamp(min=1)


def policy_loss(
    config: PolicyLossConfig,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normaliser: float | torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    seq_sum_reduce: SampleReduce | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss of one micro-batch and its metrics (detached 0-d tensors, no host sync).

    logprobs: [B, T] log pi_theta of the sampled tokens (differentiable). advantages: [B, T].
    old_logprobs: log pi_old (the policy the update is relative to); None = on-policy (ratio 1).
    rollout_logprobs: log-probs reported by the rollout engine, for TIS. ref_logprobs: for the KL
    term. entropy: [B, T] per-token policy entropy (differentiable) for the bonus.
    normaliser / seq_ids / seq_sum_reduce: see the module docstring and ``aggregate``.

    Metrics: loss, pg_loss, kl_loss, entropy (aggregated like the loss, so they add up over
    micro-batches and DP ranks); clip_frac_low/high, dual_clip_frac, approx_kl (k3 estimate of
    KL(pi_old || pi)), ratio_mean/min/max, tis_weight_mean, tis_clip_frac, kl_ref (token mean):
    local means over this micro-batch's trainable tokens, to be averaged with weight num_tokens;
    num_tokens, num_samples, num_empty_samples (samples without a trainable token here; they add 0
    to the loss). Ratio stats read 1 when there is no trainable token.
    """
    shape = loss_mask.shape
    named = {
        "logprobs": logprobs,
        "advantages": advantages,
        "old_logprobs": old_logprobs,
        "rollout_logprobs": rollout_logprobs,
        "ref_logprobs": ref_logprobs,
        "entropy": entropy,
    }
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} != loss_mask shape {tuple(shape)}"
            )
    if config.check_finite:
        check_finite(named, loss_mask)
    if isinstance(normaliser, (int, float)) and not normaliser >= 0:
        raise ValueError(f"normaliser={normaliser}; valid: >= 0 (a global token/sample count)")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs")
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy")
    if config.tis_cap is not None and rollout_logprobs is None:
        raise ValueError(f"tis_cap={config.tis_cap} needs rollout_logprobs")

    trainable = loss_mask != 0
    zero = logprobs.new_zeros((), dtype=torch.float32)

    def clean(t: torch.Tensor) -> torch.Tensor:  # masked slots may hold NaN/inf: never let them in
        return torch.where(trainable, t.float(), zero)

    logp = clean(logprobs)
    old = clean(old_logprobs) if old_logprobs is not None else logp.detach()
    adv = clean(advantages).detach()
    samples = SampleIndex.build(loss_mask, seq_ids)
    if seq_ids is not None and bool((trainable.reshape(-1) & (samples.index < 0)).any()):
        raise ValueError(
            "a trainable token has seq_ids == -1; every trainable token needs a sample"
        )
    reduce = seq_sum_reduce or (lambda x: x)
    log_ratio = logp - old
    local_counts = samples.sum(trainable.float())
    partial = torch.stack([local_counts, samples.sum(log_ratio.detach())], dim=1)
    counts, ratio_sums = reduce(partial).unbind(1)
    if config.loss_type == "gspo":
        # GSPO-token: value = exp(mean_i log ratio), gradient = value * grad log pi_t / |y_i|
        # once averaged over the sample's tokens (seq_mean_token_mean gives the paper's loss).
        seq_log_ratio = samples.gather(ratio_sums / counts.clamp(min=1), logp)
        log_ratio = logp - logp.detach() + seq_log_ratio
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    clipped = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    dual = torch.zeros_like(trainable)
    if config.dual_clip_c is not None:
        bound = -adv * config.dual_clip_c
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    tis_weight = torch.ones_like(logp)
    tis_clipped = torch.zeros_like(trainable)
    if config.tis_cap is not None:
        raw = torch.exp((old - clean(rollout_logprobs)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        tis_clipped = raw > config.tis_cap
        tis_weight = raw.clamp(max=config.tis_cap).detach()
        pg = pg * tis_weight

    agg = dict(
        loss_mask=loss_mask,
        aggregation=config.aggregation,
        samples=samples,
        normaliser=normaliser,
        sample_token_counts=counts,
    )
    pg_loss = aggregate(pg, **agg)
    loss = pg_loss
    metrics: dict[str, torch.Tensor] = {"pg_loss": pg_loss.detach()}
    num_tokens = trainable.float().sum()
    if ref_logprobs is not None:
        kl = kl_estimate(logp, clean(ref_logprobs), config.kl_estimator)
        kl_loss = aggregate(kl, **agg)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
        metrics["kl_ref"] = _masked_mean(kl, trainable, num_tokens)
    if entropy is not None:
        entropy_term = aggregate(clean(entropy), **agg)
        if config.entropy_coef != 0:
            loss = loss - config.entropy_coef * entropy_term
        metrics["entropy"] = entropy_term.detach()
    ratio_d = ratio.detach()
    if ratio_d.numel():
        inf = ratio_d.new_tensor(float("inf"))
        rmax = torch.where(trainable, ratio_d, -inf).amax()
        rmin = torch.where(trainable, ratio_d, inf).amin()
    else:
        rmax = rmin = ratio_d.new_ones(())
    has_tokens = num_tokens > 0  # with no trainable token the ratio stats read 1 (neutral)
    hi = (ratio_d > 1 + config.clip_eps_high) & (adv > 0)
    lo = (ratio_d < 1 - config.clip_eps_low) & (adv < 0)
    metrics.update(
        loss=loss.detach(),
        clip_frac_low=_masked_mean(lo.float(), trainable, num_tokens),
        clip_frac_high=_masked_mean(hi.float(), trainable, num_tokens),
        dual_clip_frac=_masked_mean(dual.float(), trainable, num_tokens),
        approx_kl=_masked_mean(kl_estimate(old, logp.detach(), "k3"), trainable, num_tokens),
        ratio_mean=_masked_mean(ratio_d, trainable, num_tokens),
        ratio_max=torch.where(has_tokens, rmax, 1.0),
        ratio_min=torch.where(has_tokens, rmin, 1.0),
        tis_weight_mean=_masked_mean(tis_weight, trainable, num_tokens),
        tis_clip_frac=_masked_mean(tis_clipped.float(), trainable, num_tokens),
        num_tokens=num_tokens,
        num_samples=num_tokens.new_tensor(float(samples.num_samples)),
        num_empty_samples=(local_counts == 0).float().sum(),
    )
    return loss, metrics
