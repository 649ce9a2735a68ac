"""Advantage estimators against hand-computed values: GRPO (std / Dr.GRPO / population std), RLOO,
REINFORCE++ with and without baseline, unequal group sizes and response lengths, packed samples,
all-equal rewards, empty responses, bad rewards, the registry and a value-based estimator.

Run: python -m pytest -q tests/unit/test_advantages.py. Tolerance: 1e-6 absolute (fp32 outputs of
float64 maths); the expected numbers are derived in the comments.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from megatron_earl.config.loss import PolicyLossConfig
from megatron_earl.training import advantages as adv_mod
from megatron_earl.training.advantages import (
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageOutput,
    available_estimators,
    build_estimator,
    register_estimator,
)
from megatron_earl.training.losses import policy_loss

ATOL = 1e-6
ALL = [
    ("grpo", {}),
    ("grpo", {"scale_by_std": False}),
    ("rloo", {}),
    ("reinforce_pp", {}),
    ("reinforce_pp", {"baseline": True}),
]


def close(actual, expected, atol: float = ATOL) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


# Samples 0-2 form group 7 (rewards 1, 0, 1; responses of 2, 3, 1 tokens), sample 3 is alone in
# group 5 (reward 1, 2 tokens). Row 0's last column is padding.
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([7, 7, 7, 5])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])


def rows(per_sample: list[float]) -> torch.Tensor:
    return torch.tensor(per_sample).unsqueeze(1) * MASK


def run(name: str, params: dict | None = None, **inputs) -> AdvantageOutput:
    fields = {"rewards": REWARDS, "group_ids": GROUPS, "loss_mask": MASK, **inputs}
    return build_estimator(name, **(params or {})).compute(AdvantageInputs(**fields))


def test_grpo_hand_values_unequal_groups_and_lengths():
    # group 7: mean 2/3, Bessel std sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3) = 0.577350
    # A = (1/3) / (0.577350 + eps) = 0.577349, (-2/3) / (0.577350 + eps) = -1.154699 (eps 1e-6)
    # group 5 has one sample: no comparison -> 0
    a = (1 / 3) / (1 / math.sqrt(3) + 1e-6)
    out = run("grpo")
    close(out.advantages, rows([a, -2 * a, a, 0.0]))
    assert out.advantages.dtype == torch.float32 and not out.advantages.requires_grad
    close(out.metrics["num_zero_std_samples"], 1.0)
    # Dr.GRPO: no std -> r - mean = 1/3, -2/3, 1/3, 0
    close(run("grpo", {"scale_by_std": False}).advantages, rows([1 / 3, -2 / 3, 1 / 3, 0.0]))
    # population std sqrt(2/9) = 0.471405: A = 0.707107, -1.414214
    b = (1 / 3) / (math.sqrt(2 / 9) + 1e-6)
    close(run("grpo", {"std_unbiased": False}).advantages, rows([b, -2 * b, b, 0.0]))


def test_rloo_hand_values():
    # group 7: A_0 = 1 - mean(0, 1) = 0.5, A_1 = 0 - mean(1, 1) = -1, A_2 = 0.5; singleton -> 0
    close(run("rloo").advantages, rows([0.5, -1.0, 0.5, 0.0]))
    # a group of 4 with rewards 3, 1, 0, 0: A_0 = 3 - 1/3 = 8/3, A_1 = 1 - 1 = 0, A_2 = 0 - 4/3
    out = run(
        "rloo",
        rewards=torch.tensor([3.0, 1.0, 0.0, 0.0]),
        group_ids=torch.zeros(4, dtype=torch.long),
    )
    close(out.advantages, rows([8 / 3, 0.0, -4 / 3, -4 / 3]))


def test_reinforce_pp_without_baseline_whitens_returns_over_tokens():
    # returns G_t = the sample's reward on each of its tokens: 5 tokens of 1, 3 tokens of 0.
    # mean 5/8, Bessel var (5 (3/8)^2 + 3 (5/8)^2) / 7 = 120/448, std 0.517549
    # A = (1 - 5/8) / std = 0.724569, (0 - 5/8) / std = -1.207615
    std = math.sqrt(120 / 448)
    hi, lo = (3 / 8) / std, -(5 / 8) / std
    close(run("reinforce_pp").advantages, rows([hi, lo, hi, hi]))


def test_reinforce_pp_baseline_hand_values():
    # group-centred: 1/3 (3 tokens), -2/3 (3 tokens), 0 (2 tokens, singleton group)
    # token mean -1/8, sum of squares 15/9, Bessel var (15/9 - 8/64) / 7 = 0.220238, std 0.469295
    # default (no re-centring): A = 1/3 / std = 0.710286, -2/3 / std = -1.420573, singleton 0
    std = math.sqrt((15 / 9 - 8 / 64) / 7)
    close(
        run("reinforce_pp", {"baseline": True}).advantages,
        rows([1 / 3 / std, -2 / 3 / std, 1 / 3 / std, 0.0]),
    )
    # shift_mean=True (as verl): (x + 1/8) / std
    shifted = [(v + 1 / 8) / std for v in (1 / 3, -2 / 3, 1 / 3, 0.0)]
    close(run("reinforce_pp", {"baseline": True, "shift_mean": True}).advantages, rows(shifted))


def test_reinforce_pp_token_rewards_accumulate_as_returns():
    # one sample, mask [1, 0, 1, 1], token rewards [-0.1, -0.2 (masked: ignored), -0.3, -0.4],
    # outcome reward 1 on the last trainable token:
    # G = [-0.1 - 0.3 - 0.4 + 1, -, -0.3 - 0.4 + 1, -0.4 + 1] = [0.2, -, 0.3, 0.6]
    # mean 11/30, Bessel std sqrt(0.086667 / 2) = 0.208167
    # A = [-0.800641, 0, -0.320256, 1.120897]
    mask = torch.tensor([[1, 0, 1, 1]])
    token_rewards = torch.tensor([[-0.1, -0.2, -0.3, -0.4]])
    g = torch.tensor([0.2, 0.3, 0.6], dtype=torch.float64)
    a = (g - g.mean()) / g.std()
    inputs = {
        "rewards": torch.tensor([1.0]),
        "group_ids": torch.tensor([0]),
        "loss_mask": mask,
        "token_rewards": token_rewards,
    }
    out = run("reinforce_pp", **inputs)
    close(out.advantages, [[a[0], 0.0, a[1], a[2]]])
    # packed: the same sample followed by a second one (reward 0, no token rewards) in one row;
    # the second sample's returns must not leak into the first's
    packed = run(
        "reinforce_pp",
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 1]),
        loss_mask=torch.tensor([[1, 0, 1, 1, 1, 1]]),
        token_rewards=torch.tensor([[-0.1, -0.2, -0.3, -0.4, 0.0, 0.0]]),
        seq_ids=torch.tensor([[0, 0, 0, 0, 1, 1]]),
    )
    g2 = torch.tensor([0.2, 0.3, 0.6, 0.0, 0.0], dtype=torch.float64)
    a2 = (g2 - g2.mean()) / g2.std()
    close(packed.advantages, [[a2[0], 0.0, a2[1], a2[2], a2[3], a2[4]]])
    # outcome estimators add the sample's token-reward sum to its reward: 1 - 0.8 = 0.2
    grpo = run(
        "grpo",
        {"scale_by_std": False},
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        loss_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]]),
        token_rewards=torch.tensor([[-0.1, -0.2, -0.3, -0.4], [0.0, 0.0, 0.0, 0.0]]),
    )
    close(grpo.advantages, [[0.1, 0.0, 0.1, 0.1], [-0.1, -0.1, 0.0, 0.0]])


def test_packed_samples_match_padded_rows():
    # pack the four samples' tokens into 2 rows: [s0 s0 s1 s1 s1] and [s2 s3 s3 pad pad]
    seq_ids = torch.tensor([[0, 0, 1, 1, 1], [2, 3, 3, -1, -1]])
    mask = (seq_ids >= 0).long()
    for name, params in ALL:
        ref = run(name, params).advantages
        packed = run(name, params, loss_mask=mask, seq_ids=seq_ids).advantages
        expected = torch.tensor(
            [
                [ref[0, 0], ref[0, 1], ref[1, 0], ref[1, 1], ref[1, 2]],
                [ref[2, 0], *ref[3, :2], 0, 0],
            ]
        )
        close(packed, expected)


@pytest.mark.parametrize(("name", "params"), ALL)
def test_all_equal_rewards_give_exact_zero_and_no_nan(name, params):
    # 0.1 is not exact in binary: the group mean differs from the rewards in the last bit, the
    # estimators must still return exactly 0 (groups of 3 and 2, whole batch equal as well)
    out = run(
        name,
        params,
        rewards=torch.full((5,), 0.1),
        group_ids=torch.tensor([0, 0, 0, 1, 1]),
        loss_mask=torch.ones(5, 4),
    )
    assert torch.equal(out.advantages, torch.zeros(5, 4))
    assert all(torch.isfinite(v).all() for v in out.metrics.values())


@pytest.mark.parametrize(("name", "params"), ALL[:3] + ALL[4:])
def test_all_equal_group_is_zero_next_to_a_varied_group(name, params):
    out = run(
        name,
        params,
        rewards=torch.tensor([2.0, 2.0, 2.0, 0.0, 1.0]),
        group_ids=torch.tensor([3, 3, 3, 4, 4]),
        loss_mask=torch.ones(5, 2),
    )
    assert torch.equal(out.advantages[:3], torch.zeros(3, 2))
    assert (out.advantages[3] < 0).all() and (out.advantages[4] > 0).all()


def test_empty_response_counts_in_its_group_baseline():
    # sample 1 has 0 trainable tokens but its reward 0 is part of the group: mean 0.5,
    # Bessel std 0.707107 -> A_0 = 0.5 / (0.707107 + 1e-6) = 0.707106; sample 1 has no token
    out = run(
        "grpo",
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        loss_mask=torch.tensor([[1, 1], [0, 0]]),
    )
    close(out.advantages, [[0.5 / (math.sqrt(0.5) + 1e-6)] * 2, [0.0, 0.0]])
    one_empty = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]])
    for name, params in ALL:  # every estimator: finite, and nothing lands on the empty sample
        out = run(name, params, loss_mask=one_empty)
        assert torch.isfinite(out.advantages).all() and not out.advantages[1].any()
    # a batch with no trainable token at all, or no response token (T = 0): zeros, finite metrics
    for name, params in ALL:
        for mask in (torch.zeros(4, 3), torch.zeros(4, 0)):
            out = run(name, params, loss_mask=mask)
            assert torch.equal(out.advantages, torch.zeros_like(mask))
            assert all(torch.isfinite(v).all() for v in out.metrics.values())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_rewards_raise_naming_the_sample(bad):
    rewards = REWARDS.clone()
    rewards[2] = bad
    for name, params in ALL:
        with pytest.raises(ValueError, match=r"rewards of samples \[2\] are not finite"):
            run(name, params, rewards=rewards)
    token_rewards = torch.zeros(4, 3)
    token_rewards[1, 2] = bad
    with pytest.raises(ValueError, match="token_rewards has 1 non-finite"):
        run("reinforce_pp", token_rewards=token_rewards)
    token_rewards[1, 2], token_rewards[0, 2] = 0.0, bad  # masked slot: ignored
    assert torch.isfinite(run("reinforce_pp", token_rewards=token_rewards).advantages).all()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="3 rows but there are 4 rewards"):
        run("grpo", loss_mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match="group_ids must be integers"):
        run("grpo", group_ids=GROUPS.float())
    with pytest.raises(ValueError, match="rewards and group_ids must both be"):
        run("grpo", group_ids=GROUPS[:3])
    with pytest.raises(ValueError, match="eps=0"):
        build_estimator("grpo", eps=0)


def test_stats_reduce_combines_batch_whitening_across_ranks():
    # two "DP ranks" each hold two groups; REINFORCE++ whitening with the summed statistics equals
    # one call over the whole batch
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 3.0, 1.0, 2.0, 2.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    mask = torch.arange(5).expand(8, 5) < torch.tensor([[5], [2], [3], [1], [4], [5], [2], [3]])
    for params in ({}, {"baseline": True}):
        est = build_estimator("reinforce_pp", **params)
        full = est.compute(AdvantageInputs(rewards, groups, mask.long())).advantages
        parts = [slice(0, 4), slice(4, 8)]
        seen: list[torch.Tensor] = []

        def capture(stats, seen=seen):
            seen.append(stats)
            return stats

        for h in parts:  # first pass: each rank's local statistics
            est.compute(
                AdvantageInputs(rewards[h], groups[h], mask[h].long(), stats_reduce=capture)
            )
        total = seen[0] + seen[1]
        split = [
            est.compute(
                AdvantageInputs(
                    rewards[h], groups[h], mask[h].long(), stats_reduce=lambda s, t=total: t
                )
            ).advantages
            for h in parts
        ]
        close(torch.cat(split), full)


def test_registry_and_a_value_based_estimator():
    assert set(available_estimators()) >= {"grpo", "rloo", "reinforce_pp"}
    with pytest.raises(ValueError, match=r"'ppo_gae'.*valid: \("):
        build_estimator("ppo_gae")
    with pytest.raises(ValueError, match="already registered"):
        register_estimator(adv_mod.GRPO)

    @dataclass(frozen=True)
    class OneStepTD(AdvantageEstimator):
        """Toy per-token critic estimator: A_t = r - V_t, returns = r (shows values flow in)."""

        name: ClassVar[str] = "test_one_step_td"
        needs_values: ClassVar[bool] = True

        def compute(self, inputs: AdvantageInputs) -> AdvantageOutput:
            trainable = inputs.loss_mask != 0
            target = inputs.rewards.unsqueeze(1).expand_as(inputs.values)
            adv = torch.where(trainable, target - inputs.values, 0.0)
            return AdvantageOutput(adv, torch.where(trainable, target, 0.0))

    register_estimator(OneStepTD)
    try:
        out = build_estimator("test_one_step_td").compute(
            AdvantageInputs(
                torch.tensor([1.0]),
                torch.tensor([0]),
                torch.tensor([[1, 1, 0]]),
                values=torch.tensor([[0.25, 0.5, 9.0]]),
            )
        )
        close(out.advantages, [[0.75, 0.5, 0.0]])
        close(out.returns, [[1.0, 1.0, 0.0]])
    finally:
        adv_mod._REGISTRY.pop("test_one_step_td")


def test_grpo_advantages_into_policy_loss_raise_target_probability_on_a_toy_bandit():
    # 8-armed softmax bandit, reward 1 for arm 3. Each step: 4 prompts x 4 samples, GRPO
    # advantages, token-mean PPO loss, SGD step 1.0. p(arm 3) starts at 1/8 and must grow every
    # step and pass 0.5 after 10 steps (deterministic sampling: fixed generator).
    gen = torch.Generator().manual_seed(0)
    logits = torch.zeros(8, requires_grad=True)
    grpo = build_estimator("grpo")
    probs = [1 / 8]
    for _ in range(10):
        arms = torch.multinomial(torch.softmax(logits.detach(), 0), 16, True, generator=gen)
        rewards = (arms == 3).float()
        mask = torch.ones(16, 1)
        adv = grpo.compute(AdvantageInputs(rewards, torch.arange(16) // 4, mask)).advantages
        logp = torch.log_softmax(logits, 0)[arms].unsqueeze(1)
        loss, _ = policy_loss(PolicyLossConfig(), logp, adv, mask)
        loss.backward()
        with torch.no_grad():
            logits -= 1.0 * logits.grad
            logits.grad = None
        probs.append(float(torch.softmax(logits, 0)[3]))
    assert all(b >= a for a, b in itertools.pairwise(probs)), probs
    assert probs[-1] > 0.5, probs
    print("p(target) per step:", [round(p, 3) for p in probs])
