"""PPO-clip (Schulman et al. 2017) with asymmetric clipping (DAPO clip-higher): per token,
r_t = pi/pi_old and loss max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)); with
``dual_clip_c`` set, negative-advantage terms are also bounded by -A c (as ``dual_clip``)."""

from __future__ import annotations

from typing import ClassVar

from megatron_earl.training.losses.base import (
    PolicyLoss,
    Surrogate,
    SurrogateInputs,
    clipped_ratio,
    clipped_surrogate,
    dual_clip,
)
from megatron_earl.training.losses.registry import register_loss


@register_loss
class PPOClip(PolicyLoss):
    """Token-level clipped surrogate."""

    name: ClassVar[str] = "ppo"

    def surrogate(self, inputs: SurrogateInputs) -> Surrogate:
        ratio = clipped_ratio(inputs.log_ratio)
        pg = clipped_surrogate(ratio, inputs.advantages, self.config)
        if self.config.dual_clip_c is None:
            return Surrogate(pg, ratio)
        pg, applied = dual_clip(pg, inputs.advantages, self.config.dual_clip_c)
        return Surrogate(pg, ratio, applied)
