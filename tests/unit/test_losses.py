"""Policy losses against hand-computed values: PPO clip (asymmetric, dual), GSPO, KL estimators,
entropy bonus, TIS, aggregation modes, micro-batch / CP splits, gradient direction, bad input.

Run: python -m pytest -q tests/unit/test_losses.py. Tolerances: 1e-6 absolute on fp32 values
computed from a handful of exact numbers (the expected values are written out in comments).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_earl.training.losses import (
    PolicyLossConfig,
    SampleIndex,
    aggregate,
    build_loss,
    kl_estimate,
    kl_reward_penalty,
    local_normaliser,
    policy_loss,
)

ATOL = 1e-6
LN = math.log


def close(actual, expected, atol: float = ATOL) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


def test_ppo_asymmetric_and_dual_clip_hand_values():
    # ratios r = [[1.5, 0.5], [1.1, 3.5]], advantages A = [[1, -1], [2, -1]], eps 0.2 / 0.28.
    # per-token max(-A r, -A clip(r, 0.8, 1.28)):
    #   1.5, A=+1 -> max(-1.5, -1.28) = -1.28   (clipped high, no gradient)
    #   0.5, A=-1 -> max( 0.5,  0.8 ) =  0.8    (clipped low,  no gradient)
    #   1.1, A=+2 -> max(-2.2, -2.2 ) = -2.2    (inside, d/dlogp = -A r = -2.2)
    #   3.5, A=-1 -> max( 3.5,  1.28) =  3.5 -> dual clip c=3: min(3.5, 3) = 3 (no gradient)
    # token mean: (-1.28 + 0.8 - 2.2 + 3) / 4 = 0.08; without dual clip (.. + 3.5) / 4 = 0.205
    old = torch.zeros(2, 2)
    log_ratio = torch.tensor([[LN(1.5), LN(0.5)], [LN(1.1), LN(3.5)]])
    adv = torch.tensor([[1.0, -1.0], [2.0, -1.0]])
    mask = torch.ones(2, 2)
    cfg = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0)
    logp = (old + log_ratio).requires_grad_()
    loss, m = policy_loss(cfg, logp, adv, mask, old_logprobs=old)
    close(loss, 0.08)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [-2.2 / 4, 0.0]])
    close(m["clip_frac_high"], 0.25)
    close(m["clip_frac_low"], 0.25)
    close(m["dual_clip_frac"], 0.25)
    close(m["ratio_max"], 3.5)
    close(m["ratio_min"], 0.5)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1 + 3.5) / 4)
    no_dual = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, _ = policy_loss(no_dual, old + log_ratio, adv, mask, old_logprobs=old)
    close(loss, 0.205)


def test_on_policy_ratio_is_one_and_gradient_is_minus_advantage():
    # old_logprobs=None: ratio = 1 with gradient d ratio / d logp = 1, so dL/dlogp_t = -A_t / N.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    loss, m = policy_loss(PolicyLossConfig(), logp, adv, torch.tensor([[1, 1, 0]]))
    close(loss, -(1.0 - 2.0) / 2)  # masked third token ignored: -(A0 + A1) / 2 = 0.5
    loss.backward()
    close(logp.grad, [[-0.5, 1.0, 0.0]])
    close(m["approx_kl"], 0.0)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # row 0 has one trainable token (value 2), row 1 three (1, 2, 6)
        ("token_mean", (2 + 1 + 2 + 6) / 4),  # 2.75
        ("seq_mean_token_mean", (2 / 1 + 9 / 3) / 2),  # 2.5
        ("seq_mean_token_sum", (2 + 9) / 2),  # 5.5
    ],
)
def test_aggregation_hand_values(aggregation, expected):
    values = torch.tensor([[2.0, 99.0, float("nan")], [1.0, 2.0, 6.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    samples = SampleIndex.build(mask)
    close(aggregate(values, mask, aggregation, samples), expected)
    # Dr.GRPO: seq_mean_token_sum over a constant normaliser num_samples * max_len = 2 * 3
    if aggregation == "seq_mean_token_sum":
        close(aggregate(values, mask, aggregation, samples, normaliser=6.0), 11 / 6)
    # the same through policy_loss: ratio 1, advantages -values -> pg term = values
    logp = torch.zeros(2, 3)
    loss, _ = policy_loss(PolicyLossConfig(aggregation=aggregation), logp, -values, mask)
    close(loss, expected)


def test_packed_seq_ids_match_padded_rows():
    # two samples packed into one row [a a b b b] plus padding; same as the padded [2, 3] layout
    cfg = PolicyLossConfig(aggregation="seq_mean_token_mean", loss_type="gspo")
    logp_rows = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]])
    old_rows = torch.tensor([[-1.2, -2.1, 0.0], [-0.4, -1.5, -1.3]])
    adv_rows = torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]])
    mask_rows = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ref, _ = policy_loss(cfg, logp_rows, adv_rows, mask_rows, old_logprobs=old_rows)

    def pack(t):
        return torch.cat([t[0, :2], t[1], t.new_zeros(1)]).unsqueeze(0)

    seq_ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    packed, m = policy_loss(
        cfg,
        pack(logp_rows),
        pack(adv_rows),
        pack(mask_rows),
        old_logprobs=pack(old_rows),
        seq_ids=seq_ids,
    )
    close(packed, ref)
    assert int(m["num_samples"]) == 2


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_micro_batch_split_with_global_normaliser_equals_full_batch(aggregation, loss_type):
    # 4 samples of unequal length split 2 + 2; with the global normaliser the micro-batch losses
    # (and gradients) add up to the full-batch ones.
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=gen)
    old = logp + 0.3 * (torch.rand(4, 5, generator=gen) - 0.5)
    ref = logp + 0.3 * (torch.rand(4, 5, generator=gen) - 0.5)
    adv = torch.randn(4, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    cfg = PolicyLossConfig(
        loss_type=loss_type, aggregation=aggregation, kl_coef=0.1, clip_eps_high=0.28
    )

    def run(rows, normaliser):
        x = logp[rows].clone().requires_grad_()
        loss, _ = policy_loss(
            cfg,
            x,
            adv[rows],
            mask[rows],
            old_logprobs=old[rows],
            ref_logprobs=ref[rows],
            normaliser=normaliser,
        )
        loss.backward()
        return loss, x.grad

    full_loss, full_grad = run(slice(0, 4), None)
    halves = [slice(0, 2), slice(2, 4)]
    total = sum(local_normaliser(mask[h], aggregation) for h in halves)
    assert float(total) == float(local_normaliser(mask, aggregation))
    parts = [run(h, total) for h in halves]
    close(parts[0][0] + parts[1][0], full_loss)
    close(torch.cat([parts[0][1], parts[1][1]]), full_grad)


def test_cp_split_samples_with_seq_sum_reduce():
    # Each sample's tokens split over two "CP ranks" (columns 0-2 and 3-5). GSPO's sequence ratio
    # and seq_mean_token_mean need whole-sample sums: seq_sum_reduce adds the other half's part.
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 6, generator=gen)
    old = logp + 0.2 * (torch.rand(3, 6, generator=gen) - 0.5)
    adv = torch.randn(3, 1, generator=gen).expand(3, 6).contiguous()
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    cfg = PolicyLossConfig(loss_type="gspo", aggregation="seq_mean_token_mean")
    full, _ = policy_loss(cfg, logp, adv, mask, old_logprobs=old)
    halves = [slice(0, 3), slice(3, 6)]

    def partial(h):  # what the other rank contributes to [tokens, log-ratio sum] per sample
        trainable = mask[:, h] != 0
        ratio = torch.where(trainable, logp[:, h] - old[:, h], 0.0)
        return torch.stack([trainable.float().sum(1), ratio.sum(1)], dim=1)

    total = 0.0
    for mine, other in (halves, halves[::-1]):
        loss, _ = policy_loss(
            cfg,
            logp[:, mine],
            adv[:, mine],
            mask[:, mine],
            old_logprobs=old[:, mine],
            normaliser=3.0,  # samples, counted once from the pre-split batch
            seq_sum_reduce=lambda x, other=other: x + partial(other),
        )
        total = total + loss
    close(total, full)


def test_gspo_sequence_ratio_hand_values():
    # one sample, token log ratios 0.1 and 0.3 -> s = exp(mean) = exp(0.2) = 1.221403, A = 1.
    # unclipped (eps_high 0.28): loss = -s; dL/dlogp_t = -s / 2 = -0.610701 on both tokens.
    # clipped (eps_high 0.1):    loss = -1.1, no gradient.
    old = torch.tensor([[-1.0, -2.0]])
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    s = math.exp(0.2)
    for eps_high, expected, grad in ((0.28, -s, -s / 2), (0.1, -1.1, 0.0)):
        cfg = PolicyLossConfig(
            loss_type="gspo", clip_eps_high=eps_high, aggregation="seq_mean_token_mean"
        )
        logp = (old + torch.tensor([[0.1, 0.3]])).requires_grad_()
        loss, m = policy_loss(cfg, logp, adv, mask, old_logprobs=old)
        close(loss, expected)
        loss.backward()
        close(logp.grad, [[grad, grad]])
        close(m["ratio_mean"], s)


def test_kl_estimators_hand_values():
    # r = logp - ref = [0.5, -0.5]
    # k1 = r; k2 = r^2/2 = 0.125; k3 = exp(-r) - 1 + r = [0.106531, 0.148721]
    logp = torch.tensor([[-1.0, -1.5]])
    ref = torch.tensor([[-1.5, -1.0]])
    close(kl_estimate(logp, ref, "k1"), [[0.5, -0.5]])
    close(kl_estimate(logp, ref, "k2"), [[0.125, 0.125]])
    close(kl_estimate(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_kl_loss_term_and_its_gradient_pulls_toward_reference():
    # zero advantages: loss = kl_coef * token_mean(k3) = 0.5 * (0.106531 + 0.148721) / 2
    logp = torch.tensor([[-1.0, -1.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    cfg = PolicyLossConfig(kl_coef=0.5, kl_estimator="k3")
    loss, m = policy_loss(cfg, logp, torch.zeros(1, 2), torch.ones(1, 2), ref_logprobs=ref)
    k3 = (math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5) / 2
    close(loss, 0.5 * k3)
    close(m["kl_loss"], k3)
    close(m["kl_ref"], k3)
    loss.backward()
    # d k3 / d logp = 1 - exp(-r): positive where logp > ref, negative where below -> a descent
    # step moves logp toward ref on both tokens
    assert logp.grad[0, 0] > 0 > logp.grad[0, 1]
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(cfg, logp, torch.zeros(1, 2), torch.ones(1, 2))


def test_kl_reward_penalty_is_masked_and_detached():
    logp = torch.tensor([[-1.0, -1.5, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    pen = kl_reward_penalty(logp, ref, torch.tensor([[1, 1, 0]]), coef=0.1, estimator="k1")
    close(pen, [[-0.05, 0.05, 0.0]])  # -0.1 * [0.5, -0.5], 0 on the masked NaN slot
    assert not pen.requires_grad


def test_entropy_bonus():
    # loss = pg - coef * token_mean(entropy) = 0 - 0.01 * (2 + 4) / 2 = -0.03
    entropy = torch.tensor([[2.0, 4.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    cfg = PolicyLossConfig(entropy_coef=0.01)
    loss, m = policy_loss(cfg, torch.zeros(1, 3), torch.zeros(1, 3), mask, entropy=entropy)
    close(loss, -0.03)
    close(m["entropy"], 3.0)
    loss.backward()
    close(entropy.grad, [[-0.005, -0.005, 0.0]])  # gradient ascent on entropy
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(cfg, torch.zeros(1, 3), torch.zeros(1, 3), mask)


def test_truncated_importance_sampling_hand_values():
    # pi_old / pi_rollout = [2, 0.5], cap C = 1.5 -> weights [1.5, 0.5] (detached).
    # on-policy ratio 1, A = [1, 1]: loss = -(1.5 + 0.5) / 2 = -1; dL/dlogp = -w / 2.
    old = torch.tensor([[-1.0, -1.0]])
    rollout = old - torch.tensor([[LN(2.0), LN(0.5)]])
    logp = old.clone().requires_grad_()
    cfg = PolicyLossConfig(tis_cap=1.5)
    loss, m = policy_loss(
        cfg, logp, torch.ones(1, 2), torch.ones(1, 2), old_logprobs=old, rollout_logprobs=rollout
    )
    close(loss, -1.0)
    loss.backward()
    close(logp.grad, [[-0.75, -0.25]])
    close(m["tis_clip_frac"], 0.5)
    close(m["tis_weight_mean"], 1.0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(cfg, logp, torch.ones(1, 2), torch.ones(1, 2))


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_step_moves_sampled_token_probability_with_advantage_sign(loss_type, sign):
    # toy softmax policy over 5 tokens; token 2 sampled 3 times. One SGD step on the loss raises
    # p(2) for a positive advantage and lowers it for a negative one.
    logits = torch.zeros(5, requires_grad=True)
    cfg = PolicyLossConfig(loss_type=loss_type, aggregation="seq_mean_token_mean")
    logp = torch.log_softmax(logits, 0)[2].expand(1, 3)
    p_before = float(torch.softmax(logits, 0)[2])
    loss, _ = policy_loss(cfg, logp, torch.full((1, 3), sign), torch.ones(1, 3))
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    p_after = float(torch.softmax(logits, 0)[2])
    # dL/dlogit_2 = -A (1 - p) = -0.8 A; step 0.5 -> logit_2 += 0.4 A, others -= 0.1 A
    expected = math.exp(0.4 * sign) / (math.exp(0.4 * sign) + 4 * math.exp(-0.1 * sign))
    assert (p_after - p_before) * sign > 0
    close(p_after, expected)


def test_nan_at_masked_positions_is_ignored_and_gradients_stay_finite():
    logits = torch.zeros(2, 3, 4, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0].clone()
    logp = torch.where(torch.tensor([[True, True, False], [True, False, False]]), logp, torch.nan)
    old = torch.full((2, 3), float("inf"))
    old[0, :2] = logp[0, :2].detach()
    old[1, 0] = logp[1, 0].detach()
    adv = torch.tensor([[1.0, 1.0, float("nan")], [-1.0, float("-inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, m = policy_loss(PolicyLossConfig(dual_clip_c=3.0), logp, adv, mask, old_logprobs=old)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert all(torch.isfinite(v).all() for v in m.values())
    close(loss, -(1 + 1 - 1) / 3)


@pytest.mark.parametrize("name", ["logprobs", "advantages", "old_logprobs", "rollout_logprobs"])
def test_nonfinite_at_trainable_position_raises(name):
    tensors = {k: torch.zeros(2, 2) for k in ("logprobs", "advantages", "old_logprobs")}
    tensors["rollout_logprobs"] = torch.zeros(2, 2)
    tensors[name][1, 0] = float("nan") if name != "advantages" else float("inf")
    with pytest.raises(ValueError, match=rf"{name} has 1 non-finite.*\[\[1, 0\]\]"):
        policy_loss(
            PolicyLossConfig(tis_cap=2.0),
            tensors["logprobs"],
            tensors["advantages"],
            torch.ones(2, 2),
            old_logprobs=tensors["old_logprobs"],
            rollout_logprobs=tensors["rollout_logprobs"],
        )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_all_masked_and_empty_samples_contribute_zero_and_are_counted(aggregation):
    cfg = PolicyLossConfig(aggregation=aggregation)
    # sample 1 has no trainable token: it adds 0, is not in the default normaliser, and is counted
    logp = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [5.0, 5.0]])
    loss, m = policy_loss(cfg, logp, adv, torch.tensor([[1, 1], [0, 0]]))
    close(loss, -2.0 if aggregation == "seq_mean_token_sum" else -1.0)
    assert int(m["num_empty_samples"]) == 1 and int(m["num_samples"]) == 2
    # a fully masked micro-batch: loss 0 (not NaN), zero gradient
    loss, m = policy_loss(cfg, logp, adv, torch.zeros(2, 2))
    loss.backward()
    close(loss, 0.0)
    close(logp.grad, torch.zeros(2, 2))
    close(m["ratio_max"], 1.0)
    # zero response tokens at all (T = 0)
    loss, m = policy_loss(cfg, torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0))
    close(loss, 0.0)
    assert int(m["num_empty_samples"]) == 3


def test_bad_shapes_and_seq_ids_raise():
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss(PolicyLossConfig(), torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="seq_ids == -1"):
        policy_loss(
            PolicyLossConfig(),
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 2),
            seq_ids=torch.tensor([[0, -1]]),
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregation": "mean"}, "aggregation='mean'"),
        ({"kl_estimator": "k4"}, "kl_estimator='k4'"),
        ({"clip_eps_low": 1.0}, "clip_eps_low=1.0"),
        ({"clip_eps_high": -0.1}, "clip_eps_high=-0.1"),
        ({"dual_clip_c": 1.0}, "dual_clip_c=1.0"),
        ({"kl_coef": -1.0}, "kl_coef=-1.0"),
        ({"tis_cap": 0.0}, "tis_cap=0.0"),
        ({"entropy_coef": float("nan")}, "entropy_coef=nan"),
    ],
)
def test_config_validation_names_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_unknown_loss_type_names_the_bad_value():
    # the registry lives with the losses (config/ is a leaf): the name is checked when the loss is
    # built, and at start-up by orchestration.validate (test_loss_registry)
    with pytest.raises(ValueError, match="loss_type='ppo2'"):
        build_loss(PolicyLossConfig(loss_type="ppo2"))
