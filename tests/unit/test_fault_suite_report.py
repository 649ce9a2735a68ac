"""``bench faults``' accounting across a trainer kill: the resumed run's producers count from
zero, so each run's groups are counted from its own first step and its cumulative counters are
added."""

from __future__ import annotations

from megatron_earl.bench import fault_suite


def record(consumed: int, failovers: float, moved: float, produced: int | None = None) -> dict:
    return {
        "rollout/async_produced_groups": consumed if produced is None else produced,
        "rollout/async_consumed_groups": consumed,
        "rollout/async_discarded_groups": 0.0,
        "rollout/async_buffered_groups": 0.0,
        "rollout/trajectories": fault_suite.GROUPS * fault_suite.SAMPLES,
        "rollout/async_engine_failovers": failovers,
        "rollout/async_moved_from_stalled": moved,
        "time/step": 1.0,
    }


def test_a_resumed_run_is_counted_from_its_own_first_step():
    g = fault_suite.GROUPS
    records = [record(g, 0, 0), record(2 * g, 2, 1), record(3 * g, 3, 1), record(g, 0, 0)]
    records.append(record(2 * g, 5, 0))
    out = fault_suite.report_dict(0, records, [], {}, 5, 4.0, 1.0)
    assert out["resumed_at_steps"] == [4]
    assert out["trained_twice_groups"] == 0 and out["lost_groups"] == 0
    assert (out["engine_failovers"], out["moved_from_stalled"]) == (8, 1)


def test_a_group_trained_twice_or_lost_after_a_resume_is_counted():
    g = fault_suite.GROUPS
    records = [
        record(g, 0, 0),
        record(2 * g, 0, 0),
        record(g, 0, 0),
        record(3 * g, 0, 0, 3 * g + 1),
    ]
    out = fault_suite.report_dict(0, records, [], {}, 4, 4.0, 1.0)
    assert out["resumed_at_steps"] == [3]
    assert out["trained_twice_groups"] == g  # step 4 is the resumed run's 2nd: 2 g expected
    assert out["lost_groups"] == 1
