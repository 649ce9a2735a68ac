"""Advantage estimators: rewards of a prompt's group of samples -> per-token advantages.

GRPO (group-normalised; ``scale_by_std=False`` is Dr.GRPO), RLOO (leave-one-out baseline),
REINFORCE++ (batch-whitened returns) and REINFORCE++-baseline (group mean baseline, then batch
std). Every estimator implements ``AdvantageEstimator.compute(AdvantageInputs) ->
AdvantageOutput`` and registers under a name (``build_estimator("grpo", scale_by_std=False)``);
per-token ``values`` and ``returns`` in the interface are there for PPO's GAE with a value head.

Pure torch, run in the experience phase. Shapes (legend): S samples; per-token tensors [B, T] like
``loss_mask`` (non-zero = trainable token); samples are the rows unless ``seq_ids`` [B, T] (int,
-1 = no sample) maps packed tokens to samples. Groups are given by ``group_ids`` [S] (any ints)
and may differ in size and in response length; a group's samples must all be in one call.
Maths and edge cases: ``docs/rl_losses.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from megatron_earl.training.losses import SampleIndex, check_finite

StatsReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 tensor [k] over the ranks that share a batch-level statistic (e.g. all-reduce
over DP for batch whitening); identity when this call holds the whole batch."""


@dataclass
class AdvantageInputs:
    """What an estimator may read. Outcome estimators need rewards and group_ids only."""

    rewards: torch.Tensor
    """[S] scalar reward per sample (finite)."""
    group_ids: torch.Tensor
    """[S] integer group (prompt) id per sample; samples of one prompt share it."""
    loss_mask: torch.Tensor
    """[B, T] non-zero where the token is trainable (model-generated)."""
    seq_ids: torch.Tensor | None = None
    """[B, T] sample id per token for packed rows (-1 = no sample); None = rows are samples."""
    token_rewards: torch.Tensor | None = None
    """[B, T] optional per-token rewards (e.g. ``losses.kl_reward_penalty``); outcome estimators
    add each sample's sum to its reward, REINFORCE++ keeps them per token."""
    values: torch.Tensor | None = None
    """[B, T] value-head estimates, for estimators with ``needs_values`` (GAE)."""
    stats_reduce: StatsReduce | None = None
    """Combines batch statistics across ranks (REINFORCE++ whitening); None = this call only."""


@dataclass
class AdvantageOutput:
    """Per-token advantages (0 on non-trainable tokens), returns for a critic, and metrics."""

    advantages: torch.Tensor
    """[B, T] float32, detached."""
    returns: torch.Tensor | None = None
    """[B, T] value targets (estimators with a critic), else None."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-d tensors: adv_mean/std/min/max over trainable tokens; num_zero_std_samples
    (samples in all-equal or singleton groups) for group-baseline estimators."""


class AdvantageEstimator(ABC):
    """A named way to turn rewards (and optionally values) into per-token advantages."""

    name: ClassVar[str]
    needs_values: ClassVar[bool] = False

    @abstractmethod
    def compute(self, inputs: AdvantageInputs) -> AdvantageOutput:
        """Advantages of every token of ``inputs`` (pure, deterministic)."""


_REGISTRY: dict[str, type[AdvantageEstimator]] = {}


def register_estimator(cls: type[AdvantageEstimator]) -> type[AdvantageEstimator]:
    """Class decorator: make ``cls`` buildable by ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"advantage estimator {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available_estimators() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def build_estimator(name: str, **params) -> AdvantageEstimator:
    """The estimator registered as ``name``, built with ``params`` (its dataclass fields)."""
    if name not in _REGISTRY:
        raise ValueError(f"advantage estimator {name!r}; valid: {available_estimators()}")
    return _REGISTRY[name](**params)


# ---------------------------------------------------------------------------------------------
# Shared pieces


def _prepare(inputs: AdvantageInputs) -> tuple[SampleIndex, torch.Tensor, torch.Tensor]:
    """Validate; return the sample index, trainable mask and float64 per-sample scores."""
    rewards, group_ids, mask = inputs.rewards, inputs.group_ids, inputs.loss_mask
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [S]; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be integers; got {group_ids.dtype}")
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        raise ValueError(
            f"rewards of samples {bad.nonzero().flatten().tolist()[:8]} are not finite "
            f"({rewards[bad].tolist()[:8]}); drop or re-score those samples before advantages"
        )
    num_samples = rewards.numel()
    if inputs.seq_ids is None and mask.shape[0] != num_samples:
        raise ValueError(f"loss_mask has {mask.shape[0]} rows but there are {num_samples} rewards")
    samples = SampleIndex.build(mask, inputs.seq_ids, num_samples)
    trainable = mask != 0
    scores = rewards.double()
    if inputs.token_rewards is not None:
        if inputs.token_rewards.shape != mask.shape:
            raise ValueError(
                f"token_rewards shape {tuple(inputs.token_rewards.shape)} != loss_mask shape "
                f"{tuple(mask.shape)}"
            )
        check_finite({"token_rewards": inputs.token_rewards}, mask)
        token_r = torch.where(trainable, inputs.token_rewards.double(), 0.0)
        scores = scores + samples.sum(token_r)
    return samples, trainable, scores


@dataclass(frozen=True)
class GroupStats:
    """Per-sample view of its group's statistics (all [S], float64 / bool)."""

    size: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    all_equal: torch.Tensor
    """True where every reward of the group is identical (also singleton groups)."""


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = True) -> GroupStats:
    """Mean, std (Bessel-corrected if ``unbiased``) and equality of each sample's group."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = scores.new_zeros(num_groups)
    size = zeros.index_add(0, inverse, torch.ones_like(scores))
    mean = zeros.index_add(0, inverse, scores) / size
    centred = scores - mean[inverse]
    dof = (size - 1).clamp(min=1) if unbiased else size
    std = (zeros.index_add(0, inverse, centred.square()) / dof).sqrt()
    gmax = zeros.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    gmin = zeros.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    return GroupStats(size[inverse], mean[inverse], std[inverse], (gmax == gmin)[inverse])


def _output(
    per_token: torch.Tensor, trainable: torch.Tensor, **extra: torch.Tensor
) -> AdvantageOutput:
    adv = torch.where(trainable, per_token, 0.0).float().detach()
    n = trainable.sum().clamp(min=1)
    mean = adv.sum() / n
    var = torch.where(trainable, adv - mean, 0.0).square().sum() / n
    if adv.numel():
        inf = adv.new_tensor(float("inf"))
        has = trainable.any()
        adv_max = torch.where(has, torch.where(trainable, adv, -inf).amax(), 0.0)
        adv_min = torch.where(has, torch.where(trainable, adv, inf).amin(), 0.0)
    else:
        adv_max = adv_min = adv.new_zeros(())
    metrics = {
        "adv_mean": mean,
        "adv_std": var.sqrt(),
        "adv_max": adv_max,
        "adv_min": adv_min,
        **{k: v.detach().float() for k, v in extra.items()},
    }
    return AdvantageOutput(adv, None, metrics)


def _whiten(
    values: torch.Tensor, trainable: torch.Tensor, shift_mean: bool, eps: float, reduce
) -> torch.Tensor:
    """(values - mean) / (std + eps) over trainable tokens (mean only if shift_mean), with
    token-weighted, Bessel-corrected statistics combined by ``reduce``. A batch whose std is
    below 1e-6 * max(1, |mean|) counts as all-equal and gives exactly 0."""
    picked = torch.where(trainable, values, 0.0)
    stats = torch.stack([trainable.double().sum(), picked.sum(), picked.square().sum()])
    count, total, total_sq = (reduce(stats) if reduce is not None else stats).unbind()
    mean = total / count.clamp(min=1)
    var = ((total_sq - count * mean.square()) / (count - 1).clamp(min=1)).clamp(min=0)
    std = var.sqrt()
    flat = std <= 1e-6 * mean.abs().clamp(min=1)
    centred = values - mean if shift_mean else values
    return torch.where(flat, 0.0, centred / (std + eps))


# ---------------------------------------------------------------------------------------------
# Estimators


@register_estimator
@dataclass(frozen=True)
class GRPO(AdvantageEstimator):
    """A_i = (r_i - mean_g) / (std_g + eps) for every token of sample i (DeepSeekMath)."""

    name: ClassVar[str] = "grpo"
    scale_by_std: bool = True
    """Divide by the group std; False = Dr.GRPO (r_i - mean_g only)."""
    std_unbiased: bool = True
    """Bessel-corrected group std (as torch.std / verl); False = population std."""
    eps: float = 1e-6
    """Added to the std before dividing."""

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps}; valid: > 0")

    def compute(self, inputs: AdvantageInputs) -> AdvantageOutput:
        samples, trainable, scores = _prepare(inputs)
        stats = group_stats(scores, inputs.group_ids, self.std_unbiased)
        adv = scores - stats.mean
        if self.scale_by_std:
            adv = adv / (stats.std + self.eps)
        adv = torch.where(stats.all_equal, 0.0, adv)
        return _output(
            samples.gather(adv, trainable),
            trainable,
            num_zero_std_samples=stats.all_equal.sum(),
        )


@register_estimator
@dataclass(frozen=True)
class RLOO(AdvantageEstimator):
    """A_i = r_i - mean_{j != i in g} r_j = n / (n - 1) * (r_i - mean_g); 0 for n = 1."""

    name: ClassVar[str] = "rloo"

    def compute(self, inputs: AdvantageInputs) -> AdvantageOutput:
        samples, trainable, scores = _prepare(inputs)
        stats = group_stats(scores, inputs.group_ids)
        adv = stats.size / (stats.size - 1).clamp(min=1) * (scores - stats.mean)
        adv = torch.where(stats.all_equal, 0.0, adv)
        return _output(
            samples.gather(adv, trainable),
            trainable,
            num_zero_std_samples=stats.all_equal.sum(),
        )


@register_estimator
@dataclass(frozen=True)
class ReinforcePlusPlus(AdvantageEstimator):
    """REINFORCE++ (Hu 2025). Without baseline: per-token return G_t (reward at the sample's last
    trainable token plus later token rewards, gamma = 1), whitened over the batch's tokens.
    With ``baseline``: A_i = r_i - mean_g on every token, divided by the batch's token std."""

    name: ClassVar[str] = "reinforce_pp"
    baseline: bool = False
    """Subtract the group mean (REINFORCE++-baseline) instead of the batch mean."""
    shift_mean: bool | None = None
    """Subtract the batch token mean when whitening. None = True without baseline, False with
    (so an all-equal group keeps advantage 0; verl shifts: set True to match it)."""
    eps: float = 1e-8
    """Added to the batch std before dividing."""

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps}; valid: > 0")

    def compute(self, inputs: AdvantageInputs) -> AdvantageOutput:
        samples, trainable, scores = _prepare(inputs)
        shift = (not self.baseline) if self.shift_mean is None else self.shift_mean
        if self.baseline:
            stats = group_stats(scores, inputs.group_ids)
            centred = torch.where(stats.all_equal, 0.0, scores - stats.mean)
            per_token = samples.gather(centred, trainable)
            extra = {"num_zero_std_samples": stats.all_equal.sum()}
        else:
            per_token = _returns(inputs, samples, trainable)
            extra = {}
        adv = _whiten(per_token, trainable, shift, self.eps, inputs.stats_reduce)
        return _output(adv, trainable, **extra)


def _returns(
    inputs: AdvantageInputs, samples: SampleIndex, trainable: torch.Tensor
) -> torch.Tensor:
    """G_t = sum of the sample's rewards at trainable positions s >= t (undiscounted). The
    outcome reward sits on the sample's last trainable token; a sample's tokens must be
    contiguous in row-major order (true for rows and for packing)."""
    flat_mask = trainable.reshape(-1)
    if not flat_mask.numel():
        return torch.zeros(trainable.shape, dtype=torch.float64, device=trainable.device)
    positions = torch.arange(flat_mask.numel(), device=flat_mask.device)
    owner = torch.where(flat_mask, samples.index, -1)
    last = torch.full((samples.num_samples,), -1, dtype=torch.long, device=positions.device)
    keep = owner >= 0
    last = last.scatter_reduce(0, owner[keep], positions[keep], "amax", include_self=True)
    rewards = torch.zeros(flat_mask.numel(), dtype=torch.float64, device=positions.device)
    if inputs.token_rewards is not None:
        tok = inputs.token_rewards.reshape(-1).double()
        rewards = torch.where(flat_mask, tok, 0.0)
    has = last >= 0
    rewards = rewards.index_add(0, last[has], inputs.rewards.double()[has])
    suffix = rewards.flip(0).cumsum(0).flip(0)  # sum over flat positions >= t
    after_last = suffix[last.clamp(min=0)] - rewards[last.clamp(min=0)]
    returns = suffix - torch.where(keep, after_last[samples.index.clamp(min=0)], 0.0)
    return torch.where(keep, returns, 0.0).reshape(trainable.shape)
