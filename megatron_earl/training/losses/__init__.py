"""RL policy losses: a registry of named losses (``ppo`` clip, ``dual_clip``, ``gspo``) over one
shared shell (KL to a reference, entropy bonus, the off-policy correction of the decoupled
objective: truncated / masked importance sampling, aggregation that stays exact across
micro-batches).

    loss_fn = build_loss(PolicyLossConfig(loss_type="gspo"))      # once per train step
    loss, metrics = loss_fn(logprobs, advantages, loss_mask, old_logprobs=old, ...)
    loss, metrics = policy_loss(config, logprobs, advantages, loss_mask, ...)   # the same

Pure torch, no process groups: the train step calls the loss on the last pipeline stage with
per-token log-probs of the sampled tokens. A new loss is one module here: a ``PolicyLoss`` subclass
with a ``name`` and a ``surrogate``, decorated with ``@register_loss`` and imported below (its
settings type, ``PolicyLossConfig``, is ``config.loss``'s). The maths, bad input, the micro-batch
normaliser contract and how to add a loss: ``docs/rl_losses.md``.

Modules: ``common`` (sample index, checks, KL estimators, aggregation), ``registry``, ``base`` (the
interface and the shared shell), ``off_policy`` (the behaviour importance weight), one module per
loss.
"""

from __future__ import annotations

import torch

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.training.losses import dual_clip, gspo, ppo_clip  # noqa: F401  (register)
from megatron_earl.training.losses.base import PolicyLoss, Surrogate, SurrogateInputs
from megatron_earl.training.losses.common import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    SampleIndex,
    SampleReduce,
    aggregate,
    check_finite,
    kl_estimate,
    kl_reward_penalty,
    local_normaliser,
)
from megatron_earl.training.losses.registry import available_losses, build_loss, register_loss

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "PolicyLoss",
    "PolicyLossConfig",
    "SampleIndex",
    "SampleReduce",
    "Surrogate",
    "SurrogateInputs",
    "aggregate",
    "available_losses",
    "build_loss",
    "check_finite",
    "kl_estimate",
    "kl_reward_penalty",
    "local_normaliser",
    "policy_loss",
    "register_loss",
]


def policy_loss(
    config: PolicyLossConfig,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    **inputs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss of one micro-batch and its metrics (detached 0-d tensors, no host sync):
    ``build_loss(config)(logprobs, advantages, loss_mask, **inputs)``.

    logprobs: [B, T] log pi_theta of the sampled tokens (differentiable). advantages: [B, T].
    Keyword ``inputs``: old_logprobs (log pi_old, the policy the update is relative to; None =
    on-policy, ratio 1), rollout_logprobs (the behaviour policy's, from the rollout engine: the
    off-policy correction's w = pi_old / pi_rollout), ref_logprobs (for the
    KL term), entropy ([B, T] per-token policy entropy, differentiable, for the bonus),
    normaliser / seq_ids / seq_sum_reduce (``losses.common`` docstring and ``aggregate``).

    Metrics: loss, pg_loss, kl_loss, entropy (aggregated like the loss, so they add up over
    micro-batches and DP ranks); clip_frac_low/high, dual_clip_frac, approx_kl (k3 estimate of
    KL(pi_old || pi)), ratio_mean/min/max, tis_weight_mean, tis_clip_frac, is_mask_frac,
    is_weight_mean/min/max, kl_ref (token mean): local means over this micro-batch's trainable
    tokens, to be averaged with weight num_tokens; num_tokens, num_samples, num_empty_samples
    (samples without a trainable token here; they add 0 to the loss); is_seq_clipped,
    is_seq_masked (samples whose sequence-level w was truncated / masked, as shares 1 / n_i per
    token here: they add up over CP). Ratio and weight stats read 1 with no trainable token.
    """
    return build_loss(config)(logprobs, advantages, loss_mask, **inputs)
