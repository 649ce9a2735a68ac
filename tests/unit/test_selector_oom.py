"""OOM recovery (order, same data re-run, infeasible marking, termination with a clear error), the
project-enforced CPU memory budget (predicted check, measured tracking), and the OOM flag agreed
over ranks (one rank's view, its peer scripted), single process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.parallel.oom_agreement import (
    PeerOutOfMemory,
    agree_oom,
    agreement_point,
    oom_attempt,
)
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


# ---------------------------------------------------------------- the OOM agreed over ranks


class ScriptedPeer:
    """``torch.distributed`` as seen by one rank of 2: each all-reduce (MAX) meets the peer's next
    scripted flag; records this rank's flags."""

    def __init__(self, monkeypatch, peer_flags: list[int]) -> None:
        self.peer_flags = list(peer_flags)
        self.sent: list[int] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def all_reduce(self, tensor, op=None, group=None):
        assert (
            op == dist.ReduceOp.MAX and tensor.dtype == torch.int32 and tensor.device.type == "cpu"
        )
        self.sent.append(int(tensor.item()))
        tensor.fill_(max(int(tensor.item()), self.peer_flags.pop(0)))


def test_agree_oom_without_a_process_group_is_the_local_flag():
    assert agree_oom(True) is True and agree_oom(False) is False
    agreement_point()  # outside an attempt: nothing to agree, no error


def test_agree_oom_is_the_max_over_ranks(monkeypatch):
    peer = ScriptedPeer(monkeypatch, [0, 1, 0, 1])
    assert [agree_oom(False), agree_oom(False), agree_oom(True), agree_oom(True)] == [
        False,
        True,
        True,
        True,
    ]
    assert peer.sent == [0, 0, 1, 1]


def test_agreement_point_is_a_no_op_outside_an_attempt(monkeypatch):
    peer = ScriptedPeer(monkeypatch, [1])
    agreement_point()
    assert peer.sent == []
    with oom_attempt(), pytest.raises(PeerOutOfMemory, match="another rank"):
        agreement_point()
    assert peer.sent == [0]


class TwoRankPhase:
    """A phase with one agreement point mid-body; with ``oom``, a CUDA-like OOM before the point
    in the first layout it runs in."""

    def __init__(self, oom: bool) -> None:
        self.oom = oom
        self.calls: list[tuple[ParallelLayout, int]] = []

    def __call__(self, data, layout: ParallelLayout):
        self.calls.append((layout, id(data)))
        if self.oom and len(self.calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        agreement_point()  # e.g. before the gradient reduction
        return sum(len(x) for x in data)


@pytest.mark.parametrize("oom_here", [True, False])
def test_an_oom_on_one_rank_recovers_every_rank_in_the_same_layout(monkeypatch, oom_here):
    # this rank's view; the other rank runs the same phase with the OOM on the other side. Its
    # flags per agreement: attempt 1 ends at its first agreement (flag 1 if it ran out, else 0
    # at the mid-body point), attempt 2 has the point and the after-body agreement (0, 0)
    peer = ScriptedPeer(monkeypatch, [0 if oom_here else 1, 0, 0])
    sel = make_selector(speeds={DP2: 10000, PP2: 8000, TP2: 6000, CP2: 5000})
    data = [[1] * 512, [2] * 384]
    phase = TwoRankPhase(oom=oom_here)
    result, report = run_phase_with_recovery(
        phase, data, selector=sel, phase="train", lengths=[512, 384], switch=lambda lay: None
    )
    # the same number of agreements as the peer, in the same order: the ranks stay in step
    assert peer.peer_flags == [] and len(peer.sent) == 3
    assert peer.sent == ([1, 0, 0] if oom_here else [0, 0, 0])
    assert [lay for lay, _ in phase.calls] == [DP2, PP2]  # the same next layout on both sides
    assert {i for _, i in phase.calls} == {id(data)} and result == 896  # nothing lost
    assert report.layout == PP2 and report.num_ooms == 1 and sel.is_infeasible("train", DP2, 512)
    assert report.oom_peaks == {}  # an unagreed CUDA peak never enters a decision or message
    outcome = report.attempts[0][1]
    assert ("CUDA out of memory" in outcome) == oom_here and ("another rank" in outcome) != oom_here


def test_an_oom_after_the_body_on_another_rank_is_agreed(monkeypatch):
    peer = ScriptedPeer(monkeypatch, [0, 1, 0, 0])  # the peer ran out after its mid-body point
    sel = make_selector(speeds={DP2: 10000, PP2: 8000, TP2: 6000, CP2: 5000})
    phase = TwoRankPhase(oom=False)
    result, report = run_phase_with_recovery(
        phase, [[0] * 512], selector=sel, phase="train", lengths=[512], switch=lambda lay: None
    )
    assert peer.sent == [0, 0, 0, 0] and [a[0] for a in report.attempts] == [str(DP2), str(PP2)]
    assert report.attempts[0][1].startswith("OOM: another rank") and result == 512
