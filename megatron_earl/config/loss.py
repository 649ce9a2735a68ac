"""``PolicyLossConfig``: which policy loss the train step computes and its coefficients
(``training.losses``: a registry of named losses; the maths in docs/rl_losses.md). The run config
holds it under ``train.loss``. ``loss_type`` names a registered loss: the registry lives with the
losses, so the name is checked at start-up (``orchestration.validate``) and by ``build_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Which policy loss to compute and its coefficients."""

    loss_type: str = "ppo"
    """Name of a registered loss (``training.losses.available_losses()``): "ppo" (token-level
    ratio pi/pi_old, clipped), "dual_clip" (ppo plus the dual-clip bound) or "gspo"
    (sequence-level, length-normalised ratio)."""
    clip_eps_low: float = 0.2
    """Ratio is clipped below at 1 - clip_eps_low (GSPO paper: 3e-4)."""
    clip_eps_high: float = 0.2
    """Ratio is clipped above at 1 + clip_eps_high (DAPO clip-higher: 0.28; GSPO paper: 4e-4)."""
    dual_clip_c: float | None = None
    """Dual-clip bound c > 1: for negative advantages the loss is at most -A * c. None = off
    (for "dual_clip": None = its default c = 3)."""
    aggregation: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum (Dr.GRPO: seq_mean_token_sum with a
    normaliser of num_samples * max_response_length)."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term. > 0 makes the run keep a frozen reference policy
    (the policy after the warm start) and compute ref_logprobs in the experience phase."""
    kl_estimator: str = "k3"
    """k1 (log ratio), k2 (half squared log ratio) or k3 (low-variance, always >= 0)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: loss -= entropy_coef * entropy (needs entropy when != 0)."""
    tis_cap: float | None = None
    """Truncated importance sampling cap C: pg terms weighted by min(pi_old / pi_rollout, C),
    detached (needs rollout_logprobs). None = off."""
    check_finite: bool = True
    """Raise on NaN/inf inputs at trainable positions (one device sync per call)."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r}; valid: {AGGREGATIONS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator={self.kl_estimator!r}; valid: {KL_ESTIMATORS}")
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low={self.clip_eps_low}; valid: 0 <= clip_eps_low < 1")
        if not self.clip_eps_high >= 0.0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high}; valid: >= 0")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c={self.dual_clip_c}; valid: None or > 1")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef={self.kl_coef}; valid: >= 0")
        if not abs(self.entropy_coef) < float("inf"):
            raise ValueError(f"entropy_coef={self.entropy_coef}; valid: a finite number")
        if self.tis_cap is not None and not 0.0 < self.tis_cap < float("inf"):
            raise ValueError(f"tis_cap={self.tis_cap}; valid: None or a finite number > 0")
