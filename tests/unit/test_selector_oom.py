"""OOM recovery (order, same data re-run, infeasible marking, termination with a clear error) and
the project-enforced CPU memory budget (predicted check, measured tracking), single process."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.budget import BudgetExceeded, MemoryBudget
from megatron_earl.selector.oom import PhaseOutOfMemory, run_phase_with_recovery
from tests.unit.test_selector_decide import CP2, DP2, PP2, TP2, make_selector

MiB = 1 << 20


class Recorder:
    """A phase that runs out of memory in the given layouts and records every call."""

    def __init__(self, oom_in: set[ParallelLayout]) -> None:
        self.oom_in = oom_in
        self.calls: list[tuple[ParallelLayout, int]] = []
        self.switches: list[ParallelLayout] = []

    def switch(self, layout: ParallelLayout) -> None:
        self.switches.append(layout)

    def phase(self, data, layout: ParallelLayout):
        self.calls.append((layout, id(data)))
        if layout in self.oom_in:
            raise BudgetExceeded("measured peak over budget", peak_bytes=99 * MiB, limit_bytes=1)
        return sum(len(x) for x in data)


def test_oom_switches_to_the_next_candidate_with_the_same_data():
    sel = make_selector(speeds={DP2: 10000, PP2: 8000, TP2: 6000, CP2: 5000})
    data = [[1] * 512, [2] * 384]
    rec = Recorder(oom_in={DP2})
    result, report = run_phase_with_recovery(
        rec.phase, data, selector=sel, phase="train", lengths=[512, 384], switch=rec.switch
    )
    assert result == 896  # every sample, whole
    assert [lay for lay, _ in rec.calls] == [DP2, PP2]  # fastest, then the next fastest
    assert {i for _, i in rec.calls} == {id(data)}  # the same data object re-run
    assert rec.switches == [DP2, PP2]
    assert report.num_ooms == 1 and report.layout == PP2
    assert sel.current["train"] == PP2
    # dp2 is infeasible at this bucket and longer ones, not at shorter ones
    assert sel.is_infeasible("train", DP2, 512) and sel.is_infeasible("train", DP2, 4096)
    assert not sel.is_infeasible("train", DP2, 256)
    assert sel.decide("train", [500, 300]).layout == PP2


def test_every_candidate_tried_once_then_a_clear_error():
    sel = make_selector()
    rec = Recorder(oom_in={DP2, TP2, CP2, PP2})
    with pytest.raises(PhaseOutOfMemory) as info:
        run_phase_with_recovery(
            rec.phase, [[0] * 512], selector=sel, phase="train", lengths=[512], switch=rec.switch
        )
    tried = [lay for lay, _ in rec.calls]
    assert sorted(map(str, tried)) == sorted(map(str, (DP2, TP2, CP2, PP2)))  # each exactly once
    message = str(info.value)
    assert "smallest layout is tp2cp1pp1dp1" in message and "GiB per rank" in message
    assert "measured" in message  # the smallest layout ran and its measured peak is named
    # the next step at that length has nothing left: it fails before running anything
    rec.calls.clear()
    with pytest.raises(Exception, match="no layout"):
        run_phase_with_recovery(
            rec.phase, [[0] * 512], selector=sel, phase="train", lengths=[512], switch=rec.switch
        )
    assert rec.calls == []


def test_non_oom_errors_are_not_swallowed():
    sel = make_selector()

    def broken(data, layout):
        raise ValueError("bad sample")

    with pytest.raises(ValueError, match="bad sample"):
        run_phase_with_recovery(
            broken, [1], selector=sel, phase="train", lengths=[10], switch=lambda lay: None
        )


def test_budget_predicted_check_and_oom_type():
    budget = MemoryBudget(10 * MiB)
    budget.check_predicted(9 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match=r"predicted peak 11\.0 MiB > budget 10\.0"):
        budget.check_predicted(11 * MiB, "train")
    with pytest.raises(ValueError, match="limit_bytes"):
        MemoryBudget(0)


def test_budget_tracks_live_tensors_exactly():
    budget = MemoryBudget(10 * MiB)
    with budget.track(static_bytes=1000) as measured:
        a = torch.ones(1024, 256)  # 1 MiB
        b = a * 2  # 1 MiB more, both alive
        del a, b
        c = torch.zeros(512, 256)  # 0.5 MiB after both were freed
        view = c[:10]  # a view allocates nothing
        del c, view
    assert measured.dynamic_peak_bytes == 2 * MiB
    assert measured.peak_bytes == 2 * MiB + 1000
    assert budget.checkpoint() == 2 * MiB + 1000  # no process group: this rank's peak
    with budget.track() as measured:
        big = torch.empty(12 * MiB // 4)
        with pytest.raises(BudgetExceeded, match=r"measured peak 12\.0 MiB > budget 10\.0 MiB"):
            budget.checkpoint()
        del big
