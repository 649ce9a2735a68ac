"""Dynamic sampling's pure parts (``orchestration.dynamic_sampling``): the verdict on a group, the
size of each extra round and its caps, the extra prompts' seeds (a block per step, so no step's
draws move another's prompts), which groups a step keeps, the accounting of its metrics, the
synchronous driver's rounds (``DynamicSampler.fill`` with a local stand-in for its all-gather),
and the start-up refusals. The update it gives is shown on 2 ranks in
``tests/distributed/test_dynamic_sampling.py``.

Run: python -m pytest -q tests/unit/test_dynamic_sampling.py
"""

from __future__ import annotations

import warnings

import pytest

from megatron_earl.config import ConfigError, load_config
from megatron_earl.config.dynamic_sampling import DynamicSamplingConfig
from megatron_earl.orchestration.dynamic_sampling import (
    DynamicSampler,
    GroupRecord,
    GroupVerdict,
    Selection,
    StepSampling,
    UnfilledStepWarning,
    extra_seeds,
    group_records,
    judge_group,
    next_round_size,
    select_groups,
)
from megatron_earl.orchestration.engines import Rollout
from megatron_earl.orchestration.rollout import PromptSet
from megatron_earl.rollout.agent.trajectory import EndReason, Trajectory

V = GroupVerdict


def _traj(gid: str, i: int, reward: float, ok: bool = True, **rewards: float) -> Trajectory:
    t = Trajectory(gid, i, 0)
    t.add_model_tokens([1, 2, 3], [-0.5] * 3)
    t.reward = reward
    t.rewards = {"outcome": reward, **rewards}
    if not ok:
        t.fail(EndReason.ENV_ERROR, "broken")
    return t


@pytest.mark.parametrize(
    "rewards,ok,tolerance,verdict",
    [
        ((0.0, 1.0, 0.0), (1, 1, 1), 0.0, V.INFORMATIVE),
        ((1.0, 1.0, 1.0), (1, 1, 1), 0.0, V.ALL_CORRECT),
        ((0.0, 0.0, 0.0), (1, 1, 1), 0.0, V.ALL_WRONG),
        ((0.5, 0.5, 0.5), (1, 1, 1), 0.0, V.ALL_WRONG),  # equal partial rewards: no success
        ((0.9, 1.0, 1.0), (1, 1, 1), 0.1, V.OTHER),  # within the tolerance, mixed success
        ((0.9, 1.0, 1.0), (1, 1, 1), 0.05, V.INFORMATIVE),
        ((0.0, 1.0, 1.0), (0, 1, 1), 0.0, V.ALL_CORRECT),  # the failed one is not usable
        ((0.0, 1.0, 0.0), (1, 1, 0), 0.0, V.INFORMATIVE),
        ((1.0, 0.0, 0.0), (1, 0, 0), 0.0, V.ALL_CORRECT),  # one usable trajectory: no spread
        ((1.0, 0.0, 0.0), (0, 0, 0), 0.0, V.OTHER),  # nothing usable
    ],
)
def test_verdict_on_a_group(rewards, ok, tolerance, verdict):
    group = [_traj("s0-0", i, r, bool(k)) for i, (r, k) in enumerate(zip(rewards, ok, strict=True))]
    assert judge_group(group, "reward", tolerance) == verdict


def test_verdict_reads_the_configured_metric():
    """Equal outcomes but different remote rewards: informative by "judge", not by "outcome"."""
    group = [_traj("s0-0", 0, 0.0, judge=0.2), _traj("s0-0", 1, 0.0, judge=0.7)]
    assert judge_group(group, "outcome", 0.0) == V.ALL_WRONG
    assert judge_group(group, "judge", 0.0) == V.INFORMATIVE


def test_group_records_count_usable_trajectories_and_generated_tokens():
    trajs = [_traj("s3-9", 0, 1.0), _traj("s3-9", 1, 0.0, ok=False), _traj("s3-2", 0, 0.0)]
    records = sorted(group_records(trajs, "reward", 0.0), key=lambda r: r.index)
    assert records == [GroupRecord(2, V.ALL_WRONG, 1, 1, 3), GroupRecord(9, V.ALL_CORRECT, 1, 2, 6)]


DS = DynamicSamplingConfig(enabled=True, oversample_factor=1.0, max_extra_rounds=3)


@pytest.mark.parametrize(
    "informative,drawn,extra_drawn,rounds,cap,factor,size",
    [
        (8, 8, 0, 0, 32, 1.0, 0),  # full: no extra round
        (9, 12, 4, 1, 32, 1.0, 0),  # more than full
        (4, 8, 0, 0, 32, 1.0, 8),  # 4 missing at rate 1/2
        (4, 8, 0, 0, 32, 1.5, 12),  # over-sampled
        (2, 8, 0, 0, 32, 1.0, 24),  # rate 1/4
        (0, 8, 0, 0, 32, 1.0, 32),  # none informative: counted as one (64), capped at 32
        (0, 8, 0, 0, 40, 1.0, 40),
        (6, 16, 8, 1, 32, 1.0, 6),  # 2 missing at rate 6/16: ceil(5.33)
        (6, 16, 8, 1, 10, 1.0, 2),  # the prompt cap left 2
        (6, 18, 10, 2, 10, 1.0, 0),  # the prompt cap is reached
        (6, 16, 8, 3, 32, 1.0, 0),  # the round cap is reached
    ],
)
def test_next_round_size(informative, drawn, extra_drawn, rounds, cap, factor, size):
    ds = DynamicSamplingConfig(enabled=True, oversample_factor=factor, max_extra_rounds=3)
    got = next_round_size(
        ds,
        need=8,
        informative=informative,
        drawn=drawn,
        extra_drawn=extra_drawn,
        rounds=rounds,
        cap=cap,
    )
    assert got == size


def test_extra_seeds_are_a_block_per_step_apart_from_the_training_stream():
    ds = DynamicSamplingConfig(enabled=True, seed_offset=1000)
    assert extra_seeds(ds, 0, 16, 0, 5) == (1000, 1001, 1002, 1003, 1004)
    assert extra_seeds(ds, 0, 16, 5, 3) == (1005, 1006, 1007)  # the next round goes on
    assert extra_seeds(ds, 2, 16, 0, 2) == (1032, 1033)  # step 2's block, however many before
    blocks = [set(extra_seeds(ds, s, 16, 0, 16)) for s in range(3)]
    assert not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2])
    # the extra prompts' groups continue the step's numbering
    tasks = PromptSet({}, (1005, 1006, 1007), "s0", first_index=13).tasks_for(1, 2)
    assert [(t.group_id, t.seed) for t in tasks] == [("s0-14", 1006)]


def _rec(index: int, verdict: GroupVerdict, usable: int = 4) -> GroupRecord:
    return GroupRecord(index, verdict, usable, 4, 10)


def test_select_keeps_the_first_informative_groups_in_draw_order():
    records = [_rec(i, V.INFORMATIVE if i % 3 else V.ALL_WRONG) for i in range(12)]
    assert select_groups(records[::-1], need=4, min_samples=2) == Selection(frozenset({1, 2, 4, 5}))
    # too few informative groups: they stay, no filler while they feed every DP rank
    assert select_groups(records[:3], need=4, min_samples=8) == Selection(frozenset({1, 2}))


def test_select_fills_dp_ranks_with_uninformative_groups_when_it_must():
    records = [_rec(0, V.ALL_WRONG, 0), _rec(1, V.ALL_CORRECT, 1), _rec(2, V.INFORMATIVE, 2)]
    records += [_rec(3, V.ALL_WRONG, 4), _rec(4, V.ALL_WRONG, 4)]
    assert select_groups(records, need=4, min_samples=6) == Selection(frozenset({2, 1, 3}), 2)
    nothing = [_rec(i, V.ALL_WRONG) for i in range(4)]
    assert select_groups(nothing, need=4, min_samples=2) == Selection(frozenset({0}), 1)


def _accounting(m: dict[str, float]) -> None:
    g = {k.removeprefix("dynamic_sampling/groups_"): v for k, v in m.items() if "/groups_" in k}
    assert g["drawn"] == g["kept"] + g["dropped"]
    assert (
        g["dropped"]
        == g["dropped_all_correct"] + g["dropped_all_wrong"] + g["dropped_other"] + g["surplus"]
    )


def test_metrics_account_for_every_group():
    verdicts = [V.ALL_CORRECT, V.INFORMATIVE, V.ALL_WRONG, V.OTHER]  # round 0
    verdicts += [V.INFORMATIVE, V.INFORMATIVE, V.INFORMATIVE, V.ALL_WRONG]  # one extra round
    records = tuple(_rec(i, v) for i, v in enumerate(verdicts))
    sampling = StepSampling(records, select_groups(records, 3, 2), 3, 4, 1)
    m = sampling.metrics()
    _accounting(m)
    assert m["dynamic_sampling/groups_kept"] == 3 and m["dynamic_sampling/groups_surplus"] == 1
    assert m["dynamic_sampling/groups_missing"] == 0 and m["dynamic_sampling/extra_rounds"] == 1
    assert m["dynamic_sampling/informative_fraction"] == 0.5
    assert m["dynamic_sampling/extra_trajectories"] == 16
    assert m["dynamic_sampling/extra_generated_tokens"] == 40
    unfilled = StepSampling(records[:4], select_groups(records[:4], 3, 2), 3, 4, 0)
    _accounting(unfilled.metrics())
    assert unfilled.missing == 2


class LocalSampler(DynamicSampler):
    """``DynamicSampler`` on one process: the all-gather is this rank's own records."""

    def _gather(self, trajectories):
        return sorted(
            group_records(trajectories, self.ds.metric, self.ds.tolerance), key=lambda r: r.index
        )


def _generate(reward_of, calls):
    """A rollout of ``prompts``: 2 samples per prompt, rewards from ``reward_of(seed, i)``."""

    def generate(prompts: PromptSet) -> Rollout:
        calls.append(prompts)
        trajs = []
        for task in prompts.tasks_for(0, 1):
            trajs += [_traj(task.group_id, i, reward_of(task.seed, i)) for i in range(2)]
        return Rollout(trajs, 0)

    return generate


def _config(*overrides: str):
    return load_config(
        overrides=[
            "steps=3",
            "batch.prompts_per_step=4",
            "batch.samples_per_prompt=2",
            "rollout.dynamic_sampling.enabled=true",
            *overrides,
        ]
    )


def test_fill_draws_extra_rounds_until_the_step_is_full():
    """Round 0 (seeds 4..7 of step 1) has one informative group; the extra rounds draw from step
    1's block and stop once 4 are kept; the surplus is dropped."""
    config = _config("rollout.dynamic_sampling.seed_offset=100")
    calls: list[PromptSet] = []
    generate = _generate(
        lambda seed, i: float(i) if seed in (5, 117, 118, 119, 120) else 0.0, calls
    )
    first = generate(PromptSet({}, (4, 5, 6, 7), "s1"))
    drawn, kept, sampling = LocalSampler(config).fill(1, first, generate, min_samples=1)
    # cap 16 per step: step 1's block starts at 116; round 1: 3 missing at rate 1/4 -> 12
    assert [p.seeds for p in calls[1:]] == [tuple(range(116, 128))]
    assert calls[1].first_index == 4 and sampling.extra_rounds == 1
    assert len(drawn) == 2 * 16 and [t.group_id for t in kept[::2]] == [
        "s1-1",
        "s1-5",
        "s1-6",
        "s1-7",
    ]
    m = sampling.metrics()
    _accounting(m)
    assert m["dynamic_sampling/groups_surplus"] == 1 and sampling.missing == 0


def test_a_step_that_cannot_fill_trains_on_what_it_has_and_says_so():
    config = _config(
        "rollout.dynamic_sampling.max_extra_rounds=2",
        "rollout.dynamic_sampling.max_extra_prompts=5",
    )
    calls: list[PromptSet] = []
    generate = _generate(lambda seed, i: float(i) if seed == 1 else 0.0, calls)
    first = generate(PromptSet({}, (0, 1, 2, 3), "s0"))
    with pytest.warns(UnfilledStepWarning, match=r"kept 1 informative groups of the 4 wanted"):
        _, kept, sampling = LocalSampler(config).fill(0, first, generate, min_samples=1)
    assert [len(p.seeds) for p in calls[1:]] == [5]  # 12 wanted, the prompt cap is 5
    assert sampling.missing == 3 and [t.group_id for t in kept] == ["s0-1", "s0-1"]
    m = sampling.metrics()
    _accounting(m)
    assert m["dynamic_sampling/groups_dropped_all_wrong"] == 8
    # the round cap stops it too; nothing informative at all: one filler group feeds the ranks
    config = _config("rollout.dynamic_sampling.max_extra_rounds=1")
    calls.clear()
    generate = _generate(lambda seed, i: 0.0, calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, kept, sampling = LocalSampler(config).fill(
            0, generate(PromptSet({}, (0, 1, 2, 3), "s0")), generate, min_samples=2
        )
    assert len(calls) == 2 and "and 1 uninformative groups" in str(caught[0].message)
    assert sampling.selection.filler == 1 and [t.group_id for t in kept] == ["s0-0", "s0-0"]


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["oversample_factor=0.5"], "oversample_factor (0.5) must be >= 1"),
        (["max_extra_rounds=0"], "max_extra_rounds (0) must be >= 1 with enabled: true"),
        (["max_extra_prompts=0"], "max_extra_prompts (0) must be >= 1 with enabled: true"),
        (["metric=acc"], "rollout.dynamic_sampling.metric 'acc' is not a reward of this run"),
        (["tolerance=-0.1"], "tolerance (-0.1) must be >= 0"),
        (["seed_offset=10"], "overlap the training seeds [0, 12)"),
        (["seed_offset=999990"], "overlap the eval seeds [1000000, 1000008)"),
    ],
)
def test_bad_input_is_refused_at_start_up_naming_the_value(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        _config(*(f"rollout.dynamic_sampling.{o}" for o in overrides), "eval.num_prompts=8")
    assert fragment in str(err.value)


def test_caps_of_0_are_fine_when_off_and_reward_fns_are_metrics():
    config = load_config(
        overrides=["rollout.dynamic_sampling.max_extra_rounds=0", "steps=1"]
    )  # off: the caps are not used
    assert not config.rollout.dynamic_sampling.enabled
    config = _config(
        "rollout.dynamic_sampling.metric=judge",
        "reward.service_url=http://127.0.0.1:9",
        "reward.fns=[judge]",
    )
    assert config.rollout.dynamic_sampling.metric == "judge"
    assert config.rollout.dynamic_sampling.extra_prompt_cap(4) == 16
