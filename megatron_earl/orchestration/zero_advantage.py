"""Samples whose every trainable advantage is 0 leave the step before the experience and train
phases, where that leaves the update as it was (``train.skip_zero_advantage``): the same sums
without terms that are exactly 0, so equal up to float summation order.

    rule = skip_rule(config)                      # None where the skip would change the update
    kept, skipped = skip_zero_advantage(batch, rule, min_kept)   # every rank calls
    metrics = train_micro_batches(..., RLStepConfig(..., skipped_normaliser=skipped.normaliser))

Why: under a group baseline (GRPO, RLOO, REINFORCE++ with baseline) a group whose rewards are
all equal gets advantage exactly 0 on every token (``training.advantages``: group max == min). A
loss whose terms are the advantage times a finite factor (``PolicyLoss.advantage_weighted``:
every built-in loss, behaviour weights included) then gets exactly 0 from such a sample, in its
value and in every gradient, yet its forward and backward cost what any sample's do. A weak
policy (every answer wrong) or a strong one (every answer right) makes most groups so; DAPO's
dynamic sampling drops them for the same reason. TRL and verl compute them.

Where ``skip_rule`` returns a rule:

- one mini-batch (with more, leaving samples out would change which samples share each
  optimizer step);
- ``kl_coef = 0`` and ``entropy_coef = 0`` (those terms do not vanish with the advantage);
- the loss declares ``advantage_weighted`` (a loss registered without it is never skipped);
- no dropout (other packing would draw other masks for the kept samples).

A sample with NaN/inf at a trainable position of any float field stays (``sample_infos``): the
train step drops it and counts it (``num_nonfinite_samples``), as without the skip. Not the same:
a zero-advantage sample whose *forward* gives non-finite log-probs (diverged weights) makes the
whole batch skip its optimizer step (0 x NaN), while left out it does not.

The loss normaliser still counts the skipped samples (``SkipCounts.normaliser``, added to the train
step's global one), so each kept sample's gradient is divided by what it was divided by before.

Every DP rank of the train layout needs a sample (one per mini-batch), and of the experience
layout: ``min_kept`` samples stay at least, the shortest zero-advantage ones (ties: the lower
sample id) filling up. So in a step where every advantage is 0 the train phase runs on those few
and the optimizer steps with the zero gradient it would have had (Adam's moments move as they
would have).

Metrics (``docs/metrics.md``): ``train/num_skipped_samples``, ``train/num_skipped_tokens``;
``train/loss`` and ``pg_loss`` stay the whole batch's (the skipped samples add exactly 0), while
``entropy``, ``kl_loss``, the token-mean metrics and the rollout/train log-prob mismatch cover
the trained samples.

Which ranks call: ``skip_zero_advantage`` on every rank of the world (one all-gather of per-sample
metadata on the host group); the rest is local and pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.config.loss import TOKEN_MEAN
from megatron_earl.config.run import RunConfig
from megatron_earl.dispatch import Batch
from megatron_earl.parallel.groups import host_group
from megatron_earl.training.losses.registry import registered_loss


@dataclass(frozen=True)
class SkipRule:
    """How skipped samples count in the loss normaliser (``PolicyLossConfig.aggregation``)."""

    aggregation: str
    """``token_mean``: a sample counts its trainable tokens; the seq modes: 1 if it has one."""


@dataclass(frozen=True)
class SkipCounts:
    """What the skipped samples would have added to the train step (the same on every rank)."""

    num_samples: int = 0
    """Samples left out."""
    num_tokens: int = 0
    """Their tokens (prompt included)."""
    normaliser: float = 0.0
    """Their share of the loss normaliser (``training.losses.common.local_normaliser``)."""


NO_SKIP = SkipCounts()


@dataclass(frozen=True)
class SampleInfo:
    """One sample as the skip decision sees it."""

    sample_id: int
    length: int
    zero: bool
    """Every trainable advantage is 0 and every float field finite at trainable positions (true
    for a sample with no trainable token)."""
    num_trainable: int
    """Trainable tokens (``loss_mask != 0``)."""


def skip_rule(config: RunConfig) -> SkipRule | None:
    """The rule when skipping zero-advantage samples leaves the update exact (module docstring),
    else None (``train.skip_zero_advantage`` off, or a condition fails)."""
    train, model = config.train, config.model
    loss = train.loss
    exact = (
        train.skip_zero_advantage
        and config.batch.num_mini_batches == 1
        and loss.kl_coef == 0
        and loss.entropy_coef == 0
        and model.attention_dropout == 0
        and model.hidden_dropout == 0
        and registered_loss(loss.loss_type).advantage_weighted
    )
    return SkipRule(loss.aggregation) if exact else None


def sample_infos(batch: Batch) -> list[SampleInfo]:
    """Per sample of ``batch``: id, length, whether it may leave (all-zero advantages, finite
    float fields) at its trainable positions, trainable tokens (one host copy of two per-sample
    counts)."""
    if not batch.num_samples:
        return []
    mask = batch.token_fields["loss_mask"] != 0  # NaN counts as trainable
    nonzero = mask & (batch.token_fields["advantages"] != 0)  # NaN counts as nonzero
    for t in batch.token_fields.values():
        if t.is_floating_point():  # the train step drops such a sample itself (and counts it)
            nonzero |= mask & ~torch.isfinite(t)
    seq = torch.repeat_interleave(torch.arange(batch.num_samples), torch.tensor(batch.lengths)).to(
        mask.device
    )
    counts = torch.zeros(2, batch.num_samples, dtype=torch.long, device=mask.device)
    counts[0].index_add_(0, seq, mask.long())
    counts[1].index_add_(0, seq, nonzero.long())
    trainable, nonzeros = runtime.to_host(counts).tolist()
    return [
        SampleInfo(s, n, z == 0, t)
        for s, n, t, z in zip(batch.sample_ids, batch.lengths, trainable, nonzeros, strict=True)
    ]


def plan_skip(
    infos: Sequence[SampleInfo], rule: SkipRule, min_kept: int
) -> tuple[frozenset[int], SkipCounts]:
    """The sample ids to leave out of ``infos`` (every rank's samples) and what they count: every
    zero-advantage sample, except the shortest ones (ties: lower id) while fewer than
    ``min_kept`` samples would stay. Pure; the same result on every rank."""
    zero = sorted((i for i in infos if i.zero), key=lambda i: (i.length, i.sample_id))
    keep = max(min_kept - (len(infos) - len(zero)), 0)
    dropped = zero[keep:]
    if rule.aggregation == TOKEN_MEAN:  # local_normaliser's count, per aggregation
        normaliser = float(sum(i.num_trainable for i in dropped))
    else:
        normaliser = float(sum(1 for i in dropped if i.num_trainable > 0))
    tokens = sum(i.length for i in dropped)
    return frozenset(i.sample_id for i in dropped), SkipCounts(len(dropped), tokens, normaliser)


def skip_zero_advantage(
    batch: Batch, rule: SkipRule | None, min_kept: int
) -> tuple[Batch, SkipCounts]:
    """This rank's ``batch`` without the skipped samples, and what they count (``plan_skip``
    over every rank's samples). ``rule`` None: ``batch`` as is, no communication.

    Which ranks call: every rank of the world, or none (``rule`` is the same everywhere)."""
    if rule is None:
        return batch, NO_SKIP
    local = sample_infos(batch)
    gathered: list[list[SampleInfo] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local, group=host_group())
    infos = [i for part in gathered for i in part or ()]
    dropped, counts = plan_skip(infos, rule, min_kept)
    if not counts.num_samples:
        return batch, NO_SKIP
    return batch.select([s for s in batch.sample_ids if s not in dropped]), counts
