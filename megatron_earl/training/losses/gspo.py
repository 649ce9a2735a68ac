"""GSPO (Zheng et al. 2025, GSPO-token form): one ratio per sample, the length-normalised
sequence ratio s_i = exp(mean_{t in i} log(pi/pi_old)), used on every token of the sample with
the gradient of that token's own log-prob; clipped like PPO (the paper clips tightly: eps_low
3e-4, eps_high 4e-4) and averaged with ``seq_mean_token_mean`` for the paper's loss. A set
``dual_clip_c`` bounds negative-advantage terms as in ``dual_clip``."""

from __future__ import annotations

from typing import ClassVar

from megatron_earl.training.losses.base import (
    PolicyLoss,
    Surrogate,
    SurrogateInputs,
    clipped_pg,
    clipped_ratio,
)
from megatron_earl.training.losses.registry import register_loss


@register_loss
class GSPO(PolicyLoss):
    """Sequence-level, length-normalised clipped surrogate."""

    name: ClassVar[str] = "gspo"
    advantage_weighted: ClassVar[bool] = True  # clipped_pg: -A x (clipped) ratio

    def surrogate(self, inputs: SurrogateInputs) -> Surrogate:
        # value = exp(mean_i log ratio), gradient = value * grad log pi_t / |y_i| once averaged
        # over the sample's tokens; counts and sums are whole-sample (reduced over CP).
        logp = inputs.logprobs
        mean_log_ratio = inputs.sample_log_ratio_sums / inputs.sample_token_counts.clamp(min=1)
        seq_log_ratio = inputs.samples.gather(mean_log_ratio, logp)
        ratio = clipped_ratio(logp - logp.detach() + seq_log_ratio)
        return clipped_pg(ratio, inputs.advantages, self.config, self.config.dual_clip_c)
