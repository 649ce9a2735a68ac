"""The asynchronous rollout's pure parts: which groups a rank generates (the synchronous loop's
split), AReaL's admission rule in RL steps, the buffer cap, and the consumption rule (a group
staler than ``max_staleness`` is discarded and counted, never taken; the rest are taken by global
index with their per-trajectory and per-token lags)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from megatron_earl.config import ConfigError, load_config
from megatron_earl.orchestration.async_rollout import (
    AsyncProducer,
    FinishedGroup,
    GroupPlan,
    async_metrics,
    group_ids,
)
from megatron_earl.orchestration.rollout import PromptSet
from megatron_earl.orchestration.validate import run_problems
from megatron_earl.rollout.agent.trajectory import Trajectory, TurnRecord


@pytest.mark.parametrize(("n", "world"), [(8, 2), (8, 3), (5, 5), (6, 1)])
def test_groups_follow_the_synchronous_split(n, world):
    """Rank r's groups of step s are exactly the prompts the sync loop gives it in step s, with
    the same group ids, task seeds and per-step sampling seed."""
    for rank in range(world):
        plan = GroupPlan(n, rank, world, seed=7)
        for step in range(3):
            js = range(step * plan.quota, (step + 1) * plan.quota)
            groups = [plan.group(j) for j in js]
            sync = PromptSet({}, tuple(range(step * n, (step + 1) * n)), f"s{step}")
            tasks = sync.tasks_for(rank, world)
            assert [plan.group_id(g) for g in groups] == [t.group_id for t in tasks]
            assert groups == [t.seed for t in tasks]  # task seed = global prompt index
            assert {plan.sampling_seed(g) for g in groups} == {7 * 1_000_003 + step}


def test_admission_limit_and_buffer_cap():
    plan = GroupPlan(8, 0, 2, max_staleness=2)
    assert plan.quota == 4
    assert [plan.limit(s) for s in range(3)] == [12, 16, 20]  # quota x (s + k + 1)
    assert GroupPlan(8, 0, 2).limit(0) == 4  # k = 0: exactly the step's groups
    assert GroupPlan(8, 1, 2, max_buffered_groups=10).buffer_cap() == 5
    assert GroupPlan(8, 1, 2, max_buffered_groups=8).buffer_cap() == 4
    assert GroupPlan(8, 1, 2).buffer_cap() is None
    with pytest.raises(ValueError, match="rank 3 of 4 gets no group"):
        GroupPlan(3, 3, 4)


def test_a_resumed_plan_starts_at_its_step_and_admits_relative_to_it():
    """A producer built at step 5 (a resumed run) generates step 5's groups first and may start
    as many groups ahead of the trainer as a producer that ran from step 0."""
    plan = GroupPlan(8, 1, 2, max_staleness=1, first_step=5)
    assert plan.first_group == 20
    assert plan.group_id(plan.group(plan.first_group)) == "s5-1"
    producer = AsyncProducer(plan, {}, None, None, None, group_size=2)
    producer.pushed_step = 5
    producer.started = 7
    assert producer._may_start()  # 20 + 7 < 4 x (5 + 1 + 1) = 28
    producer.started = 8
    assert not producer._may_start()  # two steps' groups: the staleness bound


def _traj(gid: str, i: int, turns: list[tuple[int, int]]) -> Trajectory:
    """A trajectory with turns of (tokens, weight version)."""
    t = Trajectory(gid, i, 0)
    start = 0
    for tokens, version in turns:
        t.add_model_tokens([1] * tokens, [-0.5] * tokens)
        t.turns.append(TurnRecord(start, start + tokens, version, "stop"))
        start += tokens
    return t


def _producer(k: int) -> AsyncProducer:
    plan = GroupPlan(2, 0, 1, max_staleness=k)
    return AsyncProducer(plan, {}, None, None, None, group_size=2)


def test_take_discards_stale_groups_and_reports_lags():
    producer = _producer(k=1)
    producer.version_step = {10: 0, 11: 1, 12: 2, 13: 3}  # version 10 pushed for step 0 ...
    ready = [
        FinishedGroup(5, [_traj("s2-1", 0, [(3, 12)]), _traj("s2-1", 1, [(2, 12), (4, 13)])]),
        FinishedGroup(1, [_traj("s0-1", 0, [(5, 10)]), _traj("s0-1", 1, [(1, 11)])]),  # lag 3
        FinishedGroup(4, [_traj("s2-0", 0, [(2, 13)]), _traj("s2-0", 1, [(6, 12)])]),
    ]
    producer._ready = list(ready)
    producer.started = producer.produced = 3
    taken = producer.take(step=3, timeout_s=1.0)
    assert [g.index for g in taken.groups] == [4, 5]  # by global index, the stale one dropped
    assert [g.index for g in taken.discarded] == [1]
    assert (producer.consumed, producer.discarded, producer.buffered()) == (2, 1, 0)
    assert sorted(taken.lags) == [0, 1, 1, 1]  # oldest turn of each taken trajectory
    assert dict(taken.token_lags) == {0: 2 + 4, 1: 6 + 3 + 2}
    producer.check_accounting()
    metrics = async_metrics(producer, taken, max_staleness=1)
    assert metrics["staleness_traj_lag0"] == 1 and metrics["staleness_traj_lag1"] == 3
    assert metrics["staleness_token_lag1"] == 11 and metrics["async_step_discarded_groups"] == 1
    assert group_ids(taken.groups, producer.plan) == {"s2-0": 4, "s2-1": 5}


def test_a_discard_wakes_the_producer_while_take_waits():
    """The trainer drops a stale group and waits for the rest of its quota: the producer (here a
    loop in its own thread that finishes new groups once woken, as admission does) must be woken
    at the discard. It was woken only after take returned, which never happened: the run hung
    (found by the fault-injection suite, a relay lagging behind the trainer)."""
    producer = _producer(k=0)
    producer.version_step = {10: 0, 11: 1}
    producer._ready = [FinishedGroup(0, [_traj("s0-0", 0, [(2, 10)]), _traj("s0-0", 1, [(2, 10)])])]
    producer.started = producer.produced = 1
    ready = threading.Event()

    async def fake_producer() -> None:
        producer._loop, producer._wake = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        await producer._wake.wait()  # admission re-checked: two fresh groups start and finish
        with producer._cond:
            for g in (2, 3):
                gid = producer.plan.group_id(g)
                fresh = [_traj(gid, i, [(2, 11)]) for i in range(2)]
                producer._ready.append(FinishedGroup(g, fresh))
                producer.started += 1
                producer.produced += 1
            producer._cond.notify_all()

    thread = threading.Thread(target=lambda: asyncio.run(fake_producer()), daemon=True)
    thread.start()
    assert ready.wait(10)
    taken = producer.take(step=1, timeout_s=10)
    assert [g.index for g in taken.groups] == [2, 3] and [g.index for g in taken.discarded] == [0]
    producer.check_accounting()


def test_take_times_out_naming_the_counts():
    producer = _producer(k=0)
    with pytest.raises(TimeoutError, match=r"0 of 2 groups ready for step 0 after 0\.05 s"):
        producer.take(step=0, timeout_s=0.05)


def test_accounting_catches_a_group_counted_twice():
    producer = _producer(k=0)
    producer.produced, producer.consumed = 1, 2
    with pytest.raises(AssertionError, match="produced 1 != consumed 2"):
        producer.check_accounting()


def test_async_config_bad_input_is_named():
    with pytest.raises(ConfigError, match=r"max_staleness \(-1\) must be >= 0"):
        load_config(overrides=["rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="mode 'later' is not one of"):
        load_config(overrides=["rollout.mode=later"])
    with pytest.raises(ConfigError, match="partial_rollout 'drop' is not one of"):
        load_config(overrides=["rollout.partial_rollout=drop"])
    config = load_config(
        overrides=[
            "rollout.mode=async",
            "rollout.max_buffered_groups=3",
            "batch.prompts_per_step=8",
        ]
    )
    problems = "\n".join(run_problems(config, 2))
    assert "rollout.mode=async needs rollout.engine=sglang" in problems
    assert "max_buffered_groups (3) < batch.prompts_per_step (8)" in problems


def test_dynamic_sampling_drops_uninformative_groups_within_the_budget():
    """``rollout.dynamic_sampling`` in async mode: an uninformative group is dropped (counted by
    verdict, its slot freed for the next prompt) until the rank's drop budget for the steps
    admitted is spent; later ones are buffered as filler, so the step still fills."""
    from megatron_earl.orchestration.dynamic_sampling import GroupVerdict

    plan = GroupPlan(2, 0, 1, max_dropped_per_step=1)  # quota 2; 1 drop per step admitted
    assert [plan.drop_budget(s) for s in range(3)] == [1, 2, 3]
    assert GroupPlan(8, 1, 2, max_dropped_per_step=5, max_staleness=1).drop_budget(0) == 6
    producer = AsyncProducer(plan, {}, None, None, None, group_size=2, judge=("reward", 0.0))
    producer.pushed_step, producer.version_step = 0, {0: 0}
    rewards = {0: (1.0, 1.0), 1: (0.0, 1.0), 2: (0.0, 0.0), 3: (1.0, 0.0)}

    async def run_one(g, gid, i, seed):
        traj = _traj(gid, i, [(3, 0)])
        traj.reward = rewards[g][i]
        return traj

    async def main() -> None:
        producer._wake = asyncio.Event()
        producer._run_one = run_one
        for g in range(2):
            producer.started += 1
            await producer._run_group(g)
        assert producer._wake.is_set()  # the drop woke the producer
        assert producer._may_start()  # 2 started, 1 dropped: 1 live < limit 2
        for g in range(2, 4):
            producer.started += 1
            await producer._run_group(g)

    asyncio.run(main())
    assert producer.dropped == {GroupVerdict.ALL_CORRECT: 1}  # group 2: over the budget
    assert [g.index for g in producer._ready] == [1, 2, 3] and producer.filler == 1
    producer.check_accounting()
    taken = producer.take(step=0, timeout_s=1.0)
    assert [g.index for g in taken.groups] == [1, 2]
    metrics = async_metrics(producer, taken, max_staleness=0)
    assert metrics["async_dropped_groups"] == metrics["async_dropped_all_correct_groups"] == 1
    assert metrics["async_dropped_all_wrong_groups"] == 0 and metrics["async_filler_groups"] == 1
    assert metrics["async_dropped_trajectories"] == 2
    assert metrics["async_dropped_generated_tokens"] == 6
    producer.check_accounting()
    assert "async_dropped_groups" not in async_metrics(_producer(k=0), taken, max_staleness=0)
