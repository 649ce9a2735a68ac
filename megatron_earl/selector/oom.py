"""OOM recovery: run a phase, and on an out-of-memory re-run the same data in the next layout.

    result, layout = run_phase_with_recovery(
        phase_fn, data, selector=selector, phase=Phase.TRAIN, lengths=lengths, switch=switch, step=s
    )

``switch(layout)`` makes ``layout`` current (process groups, model weights, optimizer state);
``phase_fn(data, layout)`` runs the phase on ``data`` in it. The wrapper:

1. asks the selector for the phase's layout (``Selector.decide``: raises ``NoFeasibleLayout``
   before anything runs when no layout is predicted to fit);
2. switches to it and runs ``phase_fn``;
3. on ``torch.OutOfMemoryError`` (a CUDA OOM, or the CPU budget's ``BudgetExceeded``) on *any*
   rank, every rank agrees on it (``parallel.oom_agreement``: one small all-reduce of a 0/1 flag
   at the phase's agreement points and after its body, so a rank that ran out alone does not
   leave the others in the phase's next collective), marks that (phase, layout, length bucket)
   infeasible (``Selector.mark_infeasible``: never chosen again at that length or longer), takes
   the fastest remaining candidate predicted to fit that was not tried in this call, and re-runs
   ``phase_fn`` on the *same* ``data`` object: no sample is lost or truncated;
4. every candidate is tried at most once per call, so it always ends: when none is left it raises
   ``PhaseOutOfMemory`` naming the smallest layout and the memory it needs.

Every rank picks the same next layout: the choice depends only on (phase, layout, the longest
length, ``lengths``, the layouts tried), the same on every rank. The OOM's message is not agreed
(the failing rank's own error; "another rank ran out of memory" on the others) and is only
logged and reported; a peak enters ``RecoveryReport.oom_peaks`` (and the exhausted message) only
from ``BudgetExceeded``, whose peak is agreed over the world or predicted from the same inputs.

The phase must leave no partial effect when it raises an OOM: the train phase's agreement point
comes before its gradient reduction and optimizer step (and the CPU budget's check before
``optimizer.step``, ``MemoryBudget.guard_optimizer``), so an agreed OOM applies no update on any
rank, and the next attempt zeroes the gradients before its forward. Which OOMs are agreed and
which are not (a rank that runs out while its peers wait for it in a TP all-reduce, for example):
``parallel/oom_agreement.py``. Which ranks call: every rank of the world, with the same
``lengths`` (decisions are deterministic).
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.parallel.oom_agreement import PeerOutOfMemory, agree_oom, oom_attempt
from megatron_earl.selector.decide import Decision, Selector
from megatron_earl.selector.memory import per_rank

logger = logging.getLogger("megatron_earl.selector")


class PhaseOutOfMemory(RuntimeError):
    """Every candidate layout ran out of memory on this phase's data."""


@dataclass
class RecoveryReport:
    """What one ``run_phase_with_recovery`` call did."""

    decision: Decision
    """The selector's decision before the phase."""
    attempts: list[tuple[str, str]] = field(default_factory=list)
    """(layout, "ok" or the OOM message) per attempt, in order."""
    oom_peaks: dict[str, int] = field(default_factory=dict)
    """Measured peak bytes of the attempts that ran out of memory (when the error says it)."""

    @property
    def num_ooms(self) -> int:
        return sum(1 for _, outcome in self.attempts if outcome != "ok")

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout.parse(self.attempts[-1][0])


def run_phase_with_recovery(
    phase_fn: Callable[[Any, ParallelLayout], Any],
    data: Any,
    *,
    selector: Selector,
    phase: str,
    lengths: Sequence[int],
    switch: Callable[[ParallelLayout], None],
    step: int = 0,
) -> tuple[Any, RecoveryReport]:
    """Run ``phase_fn(data, layout)`` in the selected layout, recovering from OOMs (module doc)."""
    decision = selector.decide(phase, lengths, step=step)
    report = RecoveryReport(decision)
    tried: list[ParallelLayout] = []
    layout = decision.layout
    while True:
        tried.append(layout)
        switch(layout)
        result, err = _attempt(phase_fn, data, layout)
        if err is None:
            report.attempts.append((str(layout), "ok"))
            return result, report
        gc.collect()
        report.attempts.append((str(layout), f"OOM: {err}"))
        if getattr(err, "peak_bytes", None) is not None:  # BudgetExceeded: agreed or predicted
            report.oom_peaks[str(layout)] = err.peak_bytes
        selector.mark_infeasible(phase, layout, decision.stats.max)
        logger.warning("selector OOM step %d phase %s layout %s: %s", step, phase, layout, err)
        remaining = selector.next_candidates(decision, lengths, tried)
        if not remaining:
            raise PhaseOutOfMemory(_exhausted(selector, decision, lengths, report)) from err
        layout = remaining[0]
        selector.current[phase] = layout


def _attempt(
    phase_fn: Callable[[Any, ParallelLayout], Any], data: Any, layout: ParallelLayout
) -> tuple[Any, torch.OutOfMemoryError | None]:
    """(result, None), or (None, the OOM) when any rank ran out of memory, on every rank.

    Exactly one agreement per rank ends the attempt: after the body, at the failing rank's OOM,
    or at the agreement point where a healthy rank learnt of it (``PeerOutOfMemory``).
    Collective (``oom_agreement.agreement_group()``)."""
    with oom_attempt():
        try:
            result = phase_fn(data, layout)
        except torch.OutOfMemoryError as err:
            # the frames the OOM unwound hold the attempt's tensors: free them before the next
            traceback.clear_frames(err.__traceback__)
            if not isinstance(err, PeerOutOfMemory):  # a peer's OOM was agreed where it was raised
                agree_oom(True)
            return None, err
        if agree_oom(False):
            return None, PeerOutOfMemory("another rank ran out of memory after this phase's body")
        return result, None


def _exhausted(
    selector: Selector, decision: Decision, lengths: Sequence[int], report: RecoveryReport
) -> str:
    peaks = {
        str(layout): selector.predicted_peak(
            decision.phase, layout, lengths, decision.stats.planned
        )
        for layout in selector.candidates
    }
    smallest = min(peaks, key=peaks.get)
    measured = report.oom_peaks.get(smallest)
    return (
        f"{decision.phase} step {decision.step}: every candidate layout ran out of memory "
        f"(tried {[name for name, _ in report.attempts]}) for a longest sequence of "
        f"{decision.stats.planned} tokens under a budget of "
        f"{per_rank(selector.config.budget_bytes)}; the smallest layout is "
        f"{smallest}, predicted to need {per_rank(peaks[smallest])}"
        + (f", measured {per_rank(measured)} when it ran" if measured else "")
    )
