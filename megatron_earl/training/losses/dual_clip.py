"""Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): the
PPO-clip terms, and for a negative advantage the term is also bounded by -A c (c > 1), so a
token whose ratio has grown far above 1 cannot dominate the update. c = ``dual_clip_c``, 3 (the
paper's value) when unset."""

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

DEFAULT_DUAL_CLIP_C = 3.0
"""The dual-clip bound c when ``PolicyLossConfig.dual_clip_c`` is None."""


@register_loss
class DualClipPPO(PolicyLoss):
    """Token-level clipped surrogate with the dual-clip bound always on."""

    name: ClassVar[str] = "dual_clip"
    advantage_weighted: ClassVar[bool] = True  # clipped_pg: -A x (clipped) ratio

    def surrogate(self, inputs: SurrogateInputs) -> Surrogate:
        c = self.config.dual_clip_c if self.config.dual_clip_c is not None else DEFAULT_DUAL_CLIP_C
        return clipped_pg(clipped_ratio(inputs.log_ratio), inputs.advantages, self.config, c)
