"""PPO-clip (Schulman et al. 2017) with asymmetric clipping (DAPO clip-higher): per token,
r_t = pi/pi_old and loss max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)); with
``dual_clip_c`` set, negative-advantage terms are also bounded by -A c (as ``dual_clip``)."""

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
class PPOClip(PolicyLoss):
    """Token-level clipped surrogate."""

    name: ClassVar[str] = "ppo"
    advantage_weighted: ClassVar[bool] = True  # clipped_pg: -A x (clipped) ratio

    def surrogate(self, inputs: SurrogateInputs) -> Surrogate:
        ratio = clipped_ratio(inputs.log_ratio)
        return clipped_pg(ratio, inputs.advantages, self.config, self.config.dual_clip_c)
