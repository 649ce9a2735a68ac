"""The off-policy correction of the decoupled PPO objective (Hilton et al. 2022; AReaL, Fu et al.
2025): the behaviour importance weight w = pi_old / pi_rollout, with pi_old the proximal policy
(``old_logprobs``, recomputed by the trainer) and pi_rollout the behaviour policy (the engine's
``rollout_logprobs``), detached, multiplies each token's policy-gradient term; the PPO ratio and
its clip stay against pi_old. ``PolicyLossConfig.off_policy_correction`` picks what is done to w:

    none     w is not applied (weight 1)
    tis      min(w, high)                               truncated IS (Yao et al. 2025)
    mis      w if low <= w <= high, else 0              masked IS (Liu et al. 2025)
    icepop   mis per token, bounds [0.5, 5] by default  IcePop (Ring-1T, 2025)

``off_policy_level`` picks w: per token (w_t), or per sample on each of its tokens: the product
prod_t w_t ("sequence") or the geometric mean exp(mean_t log w_t) ("geometric"), over the
sample's trainable tokens (whole-sample sums: reduced over CP by the caller). |log w| is clamped
to 20 before exp, like the PPO ratio. Pure torch, no communication; shapes: ``losses.common``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.training.losses.common import LOG_RATIO_CLAMP, SampleIndex


@dataclass(frozen=True)
class BehaviourWeight:
    """The correction of one micro-batch (detached; meaningful at trainable tokens only)."""

    raw: torch.Tensor
    """[B, T] w at the configured level, before truncation or masking (for the metrics)."""
    weight: torch.Tensor
    """[B, T] what multiplies the pg terms: 1 ("none"), min(w, high), or w / 0 (masks)."""
    truncated: torch.Tensor
    """[B, T] bool: w was truncated at the cap ("tis"; every token of a truncated sample)."""
    masked: torch.Tensor
    """[B, T] bool: weight 0 by a mask ("mis", "icepop"; every token of a masked sample)."""
    sample_truncated: torch.Tensor
    """[S] bool: the sample's w was truncated (sequence levels only; else all False)."""
    sample_masked: torch.Tensor
    """[S] bool: the sample's w was masked (sequence levels only; else all False)."""


def behaviour_weight(
    config: PolicyLossConfig,
    log_w: torch.Tensor,
    samples: SampleIndex,
    sample_token_counts: torch.Tensor,
    sample_log_w_sums: torch.Tensor | None,
) -> BehaviourWeight:
    """The behaviour weight of ``log_w`` [B, T] (log pi_old - log pi_rollout, detached, 0 at
    non-trainable tokens) under ``config``'s correction; ``sample_token_counts`` and
    ``sample_log_w_sums`` [S] are whole-sample sums over trainable tokens (summed over CP; the
    log-w sums are needed, and read, only at the sequence levels)."""
    level = config.off_policy_level
    num_samples = sample_token_counts.numel()
    no_sample = torch.zeros(num_samples, dtype=torch.bool, device=log_w.device)
    if level == "token":
        raw = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    else:
        assert sample_log_w_sums is not None, "sequence-level w needs whole-sample log-w sums"
        log_seq = sample_log_w_sums
        if level == "geometric":
            log_seq = log_seq / sample_token_counts.clamp(min=1)
        raw_seq = torch.exp(log_seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        raw = samples.gather(raw_seq, log_w)
    raw = raw.detach()
    correction = config.off_policy_correction
    nothing = torch.zeros_like(raw, dtype=torch.bool)
    if correction == "none":
        return BehaviourWeight(raw, torch.ones_like(raw), nothing, nothing, no_sample, no_sample)
    low, high = config.is_weight_low, config.is_weight_high

    def outside(w: torch.Tensor) -> torch.Tensor:  # bounds inclusive, as AReaL's w <= cap
        return w > high if correction == "tis" else (w < low) | (w > high)

    flagged = outside(raw)
    flagged_samples = no_sample
    if level != "token":
        flagged_samples = (sample_token_counts > 0) & outside(raw_seq)
    if correction == "tis":
        weight = raw.clamp(max=high)
        return BehaviourWeight(raw, weight, flagged, nothing, flagged_samples, no_sample)
    weight = torch.where(flagged, raw.new_zeros(()), raw)  # mis, icepop
    return BehaviourWeight(raw, weight, nothing, flagged, no_sample, flagged_samples)
