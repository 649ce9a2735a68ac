"""The rollout half of a step's metrics: trajectory, reward, advantage and length statistics
summed over every rollout source, and the rollout/train log-prob mismatch.

    metrics = rollout_metrics(trajectories, batch, max_turns, train_mismatch)   # every rank

The keys are listed in ``docs/metrics.md``; ``orchestration.loop`` adds the train step's.
Which ranks call: every rank of the world (all-reduces of host tensors on the host group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.parallel.groups import host_group
from megatron_earl.rollout.agent.trajectory import Trajectory


def rollout_metrics(
    trajs: Sequence[Trajectory], batch, max_turns: int, train_mismatch: float = 0.0
) -> dict[str, float]:
    """Step-level rollout statistics summed over the rollout sources (every rank calls; three
    all-reduces of host tensors on the host world group; the batch's token statistics come to the
    host first).

    ``rollout/logprob_mismatch`` (mean |log pi_old - log pi_rollout| over the trainable tokens)
    comes from the batch's ``old_logprobs`` when the experience phase computed them, else it is
    ``train_mismatch``: the train step's ``logprob_mismatch``, from its forward before the update
    (the same policy: ``RunConfig.old_logprobs_pass``)."""
    k = max_turns
    totals = [0.0] * (7 + 2 * k)  # Python sums, one tensor after (not a tensor op per value)
    for t in trajs:
        totals[0] += 1
        totals[1] += t.reward
        totals[2] += float(t.ok and t.reward >= 1.0)
        totals[3] += sum(t.loss_mask)
        totals[4] += len(t.token_ids)
        totals[5] += float(not t.ok)
        totals[6] += t.num_turns
        for i, turn in enumerate(t.turns[:k]):
            totals[7 + i] += len(t.prompt_ids) + turn.end
            totals[7 + k + i] += 1
    vec = torch.tensor(totals, dtype=torch.float64, device="cpu")
    longest = torch.tensor(
        [max((len(t.token_ids) for t in trajs), default=0)], dtype=torch.float64, device="cpu"
    )
    # reward sum of squares; |old - rollout log-prob| and advantage sum, sum of squares over the
    # trainable tokens; trainable tokens
    sums = torch.zeros(5, dtype=torch.float64, device="cpu")
    sums[0] = sum(t.reward**2 for t in trajs)
    old = batch.token_fields.get("old_logprobs")  # the same presence on every rank
    if batch.num_samples:
        mask = batch.token_fields["loss_mask"] > 0
        adv = batch.token_fields["advantages"][mask].double()
        diff = adv.new_zeros(())
        if old is not None:
            diff = (old - batch.token_fields["rollout_logprobs"])[mask].abs().double().sum()
        local = [diff, adv.sum(), adv.square().sum(), mask.sum().double()]
        sums[1:] += runtime.to_host(torch.stack(local))
    dist.all_reduce(vec, group=host_group())
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=host_group())
    dist.all_reduce(sums, group=host_group())
    n = max(float(vec[0]), 1.0)
    tokens = max(float(sums[4]), 1.0)
    reward_mean, adv_mean = float(vec[1]) / n, float(sums[2]) / tokens
    out = {
        "rollout/trajectories": float(vec[0]),
        "reward/mean": reward_mean,
        "reward/std": max(float(sums[0]) / n - reward_mean**2, 0.0) ** 0.5,
        "adv/mean": adv_mean,
        "adv/std": max(float(sums[3]) / tokens - adv_mean**2, 0.0) ** 0.5,
        "success_rate": float(vec[2]) / n,
        "response_len/mean": float(vec[3]) / n,
        "context_len/mean": float(vec[4]) / n,
        "context_len/max": float(longest[0]),
        "rollout/failed": float(vec[5]),
        "rollout/turns_mean": float(vec[6]) / n,
        "rollout/tokens": float(vec[4]),
        "rollout/logprob_mismatch": float(sums[1]) / tokens if old is not None else train_mismatch,
    }
    for i in range(k):
        if vec[7 + k + i] > 0:
            out[f"context_len_per_turn/{i}"] = float(vec[7 + i] / vec[7 + k + i])
    return out
