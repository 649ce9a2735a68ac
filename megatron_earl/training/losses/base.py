"""The policy-loss interface and the part every loss shares.

A loss is one ``PolicyLoss`` subclass with a ``name`` and a ``surrogate``: the per-token
policy-gradient terms and the importance ratio they use. Everything else is common and lives in
``PolicyLoss.__call__``: input checks, masking, the per-sample token counts and log-ratio sums
(reduced over CP), the off-policy correction (``losses.off_policy``: the behaviour importance
weight of the decoupled objective, truncated or masked), aggregation, the KL-to-reference term, the
entropy bonus and the metrics. ``docs/rl_losses.md`` has the maths and how to add a loss.

Shapes: see ``losses.common``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.training.losses.common import (
    LOG_RATIO_CLAMP,
    SampleIndex,
    SampleReduce,
    aggregate,
    check_finite,
    kl_estimate,
    masked_mean,
)
from megatron_earl.training.losses.off_policy import behaviour_weight


@dataclass(frozen=True)
class SurrogateInputs:
    """What a loss's surrogate may read (fp32, 0 at non-trainable positions)."""

    logprobs: torch.Tensor
    """[B, T] log pi_theta of the sampled tokens (differentiable)."""
    old_logprobs: torch.Tensor
    """[B, T] log pi_old (detached; ``logprobs.detach()`` when on-policy)."""
    log_ratio: torch.Tensor
    """[B, T] ``logprobs - old_logprobs`` (differentiable)."""
    advantages: torch.Tensor
    """[B, T] detached."""
    trainable: torch.Tensor
    """[B, T] bool: the loss mask."""
    samples: SampleIndex
    """Which sample each token belongs to."""
    sample_token_counts: torch.Tensor
    """[S] trainable tokens per sample (whole samples: summed over CP)."""
    sample_log_ratio_sums: torch.Tensor
    """[S] sum of the detached log ratio over each sample's tokens (summed over CP)."""


@dataclass(frozen=True)
class Surrogate:
    """A loss's per-token policy-gradient terms and the ratio they are built from."""

    pg: torch.Tensor
    """[B, T] per-token loss terms, before the behaviour weight and aggregation."""
    ratio: torch.Tensor
    """[B, T] importance ratio (its statistics and clip fractions are reported)."""
    dual_clipped: torch.Tensor | None = None
    """[B, T] bool where a dual-clip bound applied (None: no dual clip)."""


def masked_extremes(
    values: torch.Tensor, trainable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached (max, min) of ``values`` over the ``trainable`` tokens (-inf, inf when there is
    none; (1, 1) for an empty tensor)."""
    values = values.detach()
    if not values.numel():
        return values.new_ones(()), values.new_ones(())
    inf = values.new_tensor(float("inf"))
    return torch.where(trainable, values, -inf).amax(), torch.where(trainable, values, inf).amin()


def clipped_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio), with |log_ratio| clamped so exp never overflows."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> torch.Tensor:
    """PPO's pessimistic term max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) per token."""
    clipped = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    return torch.maximum(-advantages * ratio, -advantages * clipped)


def dual_clip(
    pg: torch.Tensor, advantages: torch.Tensor, c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound the terms of negative-advantage tokens by -A * c (Ye et al. 2020); returns the
    bounded terms and where the bound applied."""
    bound = -advantages * c
    applied = (advantages < 0) & (pg > bound)
    return torch.where(advantages < 0, torch.minimum(pg, bound), pg), applied


def clipped_pg(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig, c: float | None
) -> Surrogate:
    """The clipped surrogate of ``ratio`` (``clipped_surrogate``), dual-clipped at ``c`` when
    ``c`` is not None: what every built-in loss returns once it has its ratio."""
    pg = clipped_surrogate(ratio, advantages, config)
    if c is None:
        return Surrogate(pg, ratio)
    pg, applied = dual_clip(pg, advantages, c)
    return Surrogate(pg, ratio, applied)


class PolicyLoss(ABC):
    """A named policy loss. Subclasses set ``name`` and implement ``surrogate``; register them
    with ``@register_loss``. Instances are built once per train step (``build_loss``)."""

    name: ClassVar[str]
    advantage_weighted: ClassVar[bool] = False
    """Whether every term ``surrogate`` returns is the token's advantage times a finite factor,
    so that a sample whose advantages are all 0 adds exactly 0 to the loss and its gradients
    (the trainer then need not compute it: ``orchestration.zero_advantage``). A loss declares it;
    False by default, so a registered loss with another term is never skipped."""

    def __init__(self, config: PolicyLossConfig) -> None:
        self.config = config

    @abstractmethod
    def surrogate(self, inputs: SurrogateInputs) -> Surrogate:
        """Per-token policy-gradient terms of one micro-batch (pure, no communication)."""

    def __call__(
        self,
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
        """Loss of one micro-batch and its metrics: see ``losses.policy_loss``."""
        config = self.config
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
        correction = config.off_policy_correction
        if correction != "none" and rollout_logprobs is None:
            raise ValueError(f"off_policy_correction={correction!r} needs rollout_logprobs")

        trainable = loss_mask != 0
        zero = logprobs.new_zeros((), dtype=torch.float32)

        def clean(t: torch.Tensor) -> torch.Tensor:  # masked slots may hold NaN/inf: keep out
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
        # log w = log pi_old - log pi_rollout: the behaviour importance weight of the decoupled
        # objective (losses.off_policy); 0 (w = 1) without rollout log-probs
        rollout = clean(rollout_logprobs) if rollout_logprobs is not None else old
        log_w = (old - rollout).detach()
        local_counts = samples.sum(trainable.float())
        sums = [local_counts, samples.sum(log_ratio.detach())]
        if config.off_policy_level != "token":
            sums.append(samples.sum(log_w))  # a sequence-level w needs whole-sample sums
        whole = reduce(torch.stack(sums, dim=1)).unbind(1)
        counts, ratio_sums = whole[0], whole[1]
        log_w_sums = whole[2] if len(whole) > 2 else None
        out = self.surrogate(
            SurrogateInputs(logp, old, log_ratio, adv, trainable, samples, counts, ratio_sums)
        )
        pg, ratio = out.pg, out.ratio
        dual = out.dual_clipped if out.dual_clipped is not None else torch.zeros_like(trainable)
        behaviour = behaviour_weight(config, log_w, samples, counts, log_w_sums)
        if correction != "none":
            pg = pg * behaviour.weight

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
            metrics["kl_ref"] = masked_mean(kl, trainable, num_tokens)
        if entropy is not None:
            entropy_term = aggregate(clean(entropy), **agg)
            if config.entropy_coef != 0:
                loss = loss - config.entropy_coef * entropy_term
            metrics["entropy"] = entropy_term.detach()
        ratio_d = ratio.detach()
        rmax, rmin = masked_extremes(ratio_d, trainable)
        wmax, wmin = masked_extremes(behaviour.raw, trainable)
        # a sample counts by its share of tokens here (1 / n_i each): the counts add up over CP
        share = 1.0 / samples.gather(counts.clamp(min=1), logp)
        seq_clipped = samples.gather(behaviour.sample_truncated.float(), logp) * share
        seq_masked = samples.gather(behaviour.sample_masked.float(), logp) * share
        has_tokens = num_tokens > 0  # with no trainable token the ratio stats read 1 (neutral)
        hi = (ratio_d > 1 + config.clip_eps_high) & (adv > 0)
        lo = (ratio_d < 1 - config.clip_eps_low) & (adv < 0)
        metrics.update(
            loss=loss.detach(),
            clip_frac_low=masked_mean(lo.float(), trainable, num_tokens),
            clip_frac_high=masked_mean(hi.float(), trainable, num_tokens),
            dual_clip_frac=masked_mean(dual.float(), trainable, num_tokens),
            approx_kl=masked_mean(kl_estimate(old, logp.detach(), "k3"), trainable, num_tokens),
            ratio_mean=masked_mean(ratio_d, trainable, num_tokens),
            ratio_max=torch.where(has_tokens, rmax, 1.0),
            ratio_min=torch.where(has_tokens, rmin, 1.0),
            tis_weight_mean=masked_mean(behaviour.weight, trainable, num_tokens),
            tis_clip_frac=masked_mean(behaviour.truncated.float(), trainable, num_tokens),
            is_mask_frac=masked_mean(behaviour.masked.float(), trainable, num_tokens),
            is_weight_mean=masked_mean(behaviour.raw, trainable, num_tokens),
            is_weight_max=torch.where(has_tokens, wmax, 1.0),
            is_weight_min=torch.where(has_tokens, wmin, 1.0),
            is_seq_clipped=torch.where(trainable, seq_clipped, 0.0).sum().detach(),
            is_seq_masked=torch.where(trainable, seq_masked, 0.0).sum().detach(),
            num_tokens=num_tokens,
            num_samples=num_tokens.new_tensor(float(samples.num_samples)),
            num_empty_samples=(local_counts == 0).float().sum(),
        )
        return loss, metrics
