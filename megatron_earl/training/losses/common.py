"""What every policy loss shares: sample indexing of packed rows, input checks, the KL
estimators, and loss aggregation that stays exact across micro-batches.

Shapes (legend): per-token tensors are ``[B, T]`` (B rows, T positions), all the same shape as
``loss_mask``; a non-zero ``loss_mask`` marks a trainable (model-generated) token. Samples are
the rows unless ``seq_ids`` ``[B, T]`` (int, ``-1`` = no sample) says which sample each token of
a packed row belongs to; S is the number of samples.

Normaliser contract: a policy loss returns ``sum(per-token or per-sample terms) / normaliser``.
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

from megatron_earl.config.loss import AGGREGATIONS, KL_ESTIMATORS

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


def masked_mean(values: torch.Tensor, trainable: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Detached mean of ``values`` over the ``trainable`` tokens (``count`` of them; 0 if none)."""
    return torch.where(trainable, values, values.new_zeros(())).sum().detach() / count.clamp(min=1)
