"""The zero-advantage skip's pure parts (``orchestration.zero_advantage``) and ``Batch.select``:
which samples leave, which stay to fill every DP rank, what they count in the loss normaliser,
and when the skip applies at all. The update it leaves unchanged is shown on 2 ranks in
``tests/distributed/test_zero_advantage.py``.

Run: python -m pytest -q tests/unit/test_zero_advantage.py
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from megatron_earl.config import load_config
from megatron_earl.dispatch import Batch
from megatron_earl.dispatch.batch import BatchError
from megatron_earl.orchestration.zero_advantage import (
    SampleInfo,
    SkipRule,
    plan_skip,
    sample_infos,
    skip_rule,
    skip_zero_advantage,
)
from megatron_earl.training.losses import register_loss
from megatron_earl.training.losses import registry as registry_module
from megatron_earl.training.losses.base import PolicyLoss, Surrogate, SurrogateInputs


def _batch() -> Batch:
    """Samples 10..13 of lengths 3, 2, 4, 1: 10 has a nonzero advantage, 11 zeros, 12 a nonzero
    advantage only where the loss mask is 0, 13 no trainable token."""
    lengths = [3, 2, 4, 1]
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.float32)
    adv = torch.tensor([0, 0.5, 0.5, 0, 0, 2.0, 2.0, 0, 0, 0])
    return Batch(
        [10, 11, 12, 13],
        lengths,
        {"loss_mask": mask, "advantages": adv, "tokens": torch.arange(10)},
        {"reward": torch.tensor([1.0, 0.0, 0.0, 0.0])},
        group_ids=[0, 1, 1, 2],
    )


def test_sample_infos_read_advantages_at_trainable_tokens_only():
    infos = sample_infos(_batch())
    assert [(i.sample_id, i.length, i.zero, i.num_trainable) for i in infos] == [
        (10, 3, False, 2),
        (11, 2, True, 2),
        (12, 4, True, 2),
        (13, 1, True, 0),
    ]
    nan = _batch()
    nan.token_fields["advantages"][3] = float("nan")  # sample 11: NaN is not zero
    assert not sample_infos(nan)[1].zero
    # a non-finite value in another float field at a trainable position: the sample stays (the
    # train step drops and counts it, as without the skip); at a masked position it does not
    for position, stays in ((4, True), (5, False)):  # sample 11's trainable token; 12's masked
        bad = _batch()
        bad.token_fields["rollout_logprobs"] = torch.zeros(10)
        bad.token_fields["rollout_logprobs"][position] = float("inf")
        assert [not i.zero for i in sample_infos(bad)] == [True, stays, False, False]


def _infos() -> list[SampleInfo]:
    # ids 0..5: 1 and 4 nonzero; zero ones of lengths 9, 5, 5, 7 (ids 0, 2, 3, 5)
    return [
        SampleInfo(0, 9, True, 6),
        SampleInfo(1, 8, False, 5),
        SampleInfo(2, 5, True, 3),
        SampleInfo(3, 5, True, 0),
        SampleInfo(4, 4, False, 2),
        SampleInfo(5, 7, True, 4),
    ]


def test_plan_skip_drops_every_zero_sample_when_enough_stay():
    dropped, counts = plan_skip(_infos(), SkipRule("token_mean"), min_kept=2)
    assert dropped == {0, 2, 3, 5}
    assert (counts.num_samples, counts.num_tokens, counts.normaliser) == (
        4,
        9 + 5 + 5 + 7,
        6 + 3 + 0 + 4,
    )
    _, seq = plan_skip(_infos(), SkipRule("seq_mean_token_mean"), min_kept=2)
    assert seq.normaliser == 3  # samples with a trainable token (3 has none)


def test_plan_skip_keeps_the_shortest_zero_samples_to_fill_dp_ranks():
    # 2 nonzero + 2 fillers: the shortest zero ones, lower id first on a tie (2 before 3)
    dropped, counts = plan_skip(_infos(), SkipRule("token_mean"), min_kept=4)
    assert dropped == {0, 5} and counts.normaliser == 6 + 4
    dropped, _ = plan_skip(_infos(), SkipRule("token_mean"), min_kept=3)
    assert dropped == {0, 3, 5}
    # every advantage zero: only the fillers stay
    zero = [SampleInfo(i.sample_id, i.length, True, i.num_trainable) for i in _infos()]
    dropped, counts = plan_skip(zero, SkipRule("token_mean"), min_kept=2)
    assert set(range(6)) - dropped == {4, 2} and counts.num_samples == 4
    # more needed than there are samples: nothing leaves
    dropped, counts = plan_skip(_infos(), SkipRule("token_mean"), min_kept=7)
    assert not dropped and counts.num_samples == 0 and counts.normaliser == 0


def test_without_a_rule_the_batch_stays_and_nothing_is_communicated():
    batch = _batch()
    kept, counts = skip_zero_advantage(batch, None, 1)  # no process group: would raise if used
    assert kept is batch and counts.num_samples == 0


def test_batch_select_keeps_the_named_samples_in_order():
    batch = _batch()
    sub = batch.select([12, 10])
    assert sub.sample_ids == [12, 10] and sub.lengths == [4, 3] and sub.group_ids == [1, 0]
    assert sub.token_fields["tokens"].tolist() == [5, 6, 7, 8, 0, 1, 2]
    assert sub.sample_fields["reward"].tolist() == [0.0, 1.0]
    assert batch.select(batch.sample_ids) is batch
    with pytest.raises(BatchError, match=r"sample_ids \[99\] are not in this batch"):
        batch.select([10, 99])


@pytest.mark.parametrize(
    "overrides,applies",
    [
        ([], True),
        (["train.loss.loss_type=gspo"], True),
        (["train.loss.loss_type=dual_clip"], True),
        (["train.loss.aggregation=seq_mean_token_sum"], True),
        (["train.skip_zero_advantage=false"], False),
        (["batch.num_mini_batches=2"], False),
        (["train.loss.entropy_coef=0.01"], False),
        (["train.loss.kl_coef=0.1"], False),
        (["train.loss.loss_type=test_constant_bonus"], False),
        (["model.hidden_dropout=0.1"], False),
        (["model.attention_dropout=0.1"], False),
    ],
)
def test_the_skip_applies_only_where_the_update_stays_exact(overrides, applies, monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register_loss
    class ConstantBonus(PolicyLoss):  # a term that is not a multiple of the advantage
        name: ClassVar[str] = "test_constant_bonus"

        def surrogate(self, inputs: SurrogateInputs) -> Surrogate:
            ratio = torch.exp(inputs.log_ratio)
            return Surrogate(-inputs.advantages * ratio - 0.1 * inputs.logprobs, ratio)

    config = load_config(overrides=overrides)
    rule = skip_rule(config)
    assert (rule is not None) == applies
    if applies:
        assert rule.aggregation == config.train.loss.aggregation
