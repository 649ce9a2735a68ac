"""``PolicyLossConfig``: which policy loss the train step computes and its coefficients
(``training.losses``: a registry of named losses; the maths in docs/rl_losses.md). The run config
holds it under ``train.loss``. ``loss_type`` names a registered loss: the registry lives with the
losses, so the name is checked at start-up (``orchestration.validate``) and by ``build_loss``.
The off-policy correction (``off_policy_correction``, ``off_policy_level``, ``is_weight_low/high``)
is resolved here: ``tis_cap`` maps onto it and unset bounds take the correction's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
TOKEN_MEAN = AGGREGATIONS[0]
"""The aggregation normalised by trainable tokens (the others by samples with one)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
OFF_POLICY_CORRECTIONS = ("none", "tis", "mis", "icepop")
"""How the behaviour importance weight w = pi_old / pi_rollout enters the loss (docs/rl_losses.md,
"Off-policy correction"): not at all, truncated at a cap, masked outside bounds, IcePop."""
OFF_POLICY_LEVELS = ("token", "sequence", "geometric")
"""Which w the correction uses: per token, the sample's product, or the sample's geometric mean."""
IS_WEIGHT_DEFAULTS = {"tis": (None, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0)}
"""(is_weight_low, is_weight_high) of each correction when left unset: TIS and MIS cap C = 2
(Yao et al. 2025; Liu et al. 2025), IcePop's [0.5, 5] (Ring-1T)."""


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
    off_policy_correction: str = "none"
    """Behaviour importance weight w = pi_old / pi_rollout on the pg terms (decoupled PPO; needs
    rollout_logprobs): "none" (w not applied), "tis" (min(w, is_weight_high)), "mis" (w where
    is_weight_low <= w <= is_weight_high, else 0: the token leaves the pg term), "icepop" (mis
    per token with IcePop's bounds [0.5, 5]). Detached; docs/rl_losses.md."""
    off_policy_level: str = "token"
    """Which w "tis"/"mis" use: "token" (per token), "sequence" (the sample's product of token
    weights, on each of its tokens) or "geometric" (the sample's geometric mean)."""
    is_weight_low: float | None = None
    """Lower bound of w for "mis"/"icepop" (below it: masked). None = the correction's default
    (mis 0: one-sided; icepop 0.5); not for "tis"."""
    is_weight_high: float | None = None
    """Cap of w for "tis" (truncated above it), upper bound for "mis"/"icepop" (above it:
    masked). None = the correction's default (tis, mis 2; icepop 5)."""
    tis_cap: float | None = None
    """Legacy spelling of off_policy_correction "tis" at the token level with is_weight_high =
    tis_cap (pg terms weighted by min(pi_old / pi_rollout, C), detached). None = off."""
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
        self._resolve_off_policy()

    def _resolve_off_policy(self) -> None:
        """Check the off-policy settings, map the legacy ``tis_cap`` and fill the correction's
        default bounds in place (frozen: ``object.__setattr__``), so the resolved config shows
        the bounds the loss uses."""
        correction, level = self.off_policy_correction, self.off_policy_level
        low, high = self.is_weight_low, self.is_weight_high
        if correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"off_policy_correction={correction!r}; valid: {OFF_POLICY_CORRECTIONS}"
            )
        if level not in OFF_POLICY_LEVELS:
            raise ValueError(f"off_policy_level={level!r}; valid: {OFF_POLICY_LEVELS}")
        if self.tis_cap is not None:
            if correction not in ("none", "tis") or level != "token":
                raise ValueError(
                    f"tis_cap={self.tis_cap} is the legacy spelling of off_policy_correction="
                    f"'tis' at off_policy_level='token'; it cannot combine with "
                    f"off_policy_correction={correction!r}, off_policy_level={level!r} "
                    "(set is_weight_high instead)"
                )
            if high is not None and high != self.tis_cap:
                raise ValueError(
                    f"tis_cap={self.tis_cap} and is_weight_high={high} disagree; set one of them"
                )
            correction, high = "tis", self.tis_cap
        if correction == "none":
            if (low, high, level) != (None, None, "token"):
                raise ValueError(
                    f"off_policy_correction='none' applies no weight, yet is_weight_low={low}, "
                    f"is_weight_high={high}, off_policy_level={level!r} are set; valid: leave "
                    f"them unset, or pick a correction from {OFF_POLICY_CORRECTIONS[1:]}"
                )
            return
        if correction == "icepop" and level != "token":
            raise ValueError(
                f"off_policy_level={level!r} with off_policy_correction='icepop'; valid: "
                "'token' (IcePop masks tokens; for sequences use 'mis')"
            )
        if correction == "tis" and low is not None:
            raise ValueError(
                f"is_weight_low={low} with off_policy_correction='tis'; valid: None (TIS only "
                "truncates above, at is_weight_high; a lower bound masks: use 'mis')"
            )
        default_low, default_high = IS_WEIGHT_DEFAULTS[correction]
        low = default_low if low is None else low
        high = default_high if high is None else high
        if not 0.0 < high < float("inf"):
            raise ValueError(f"is_weight_high={high}; valid: a finite number > 0")
        if low is not None and not 0.0 <= low < high:
            raise ValueError(
                f"is_weight_low={low}; valid: 0 <= is_weight_low < is_weight_high ({high})"
            )
        object.__setattr__(self, "off_policy_correction", correction)
        object.__setattr__(self, "is_weight_low", low)
        object.__setattr__(self, "is_weight_high", high)
