"""OOM recovery: run a phase, and on an out-of-memory re-run the same data in the next layout.

    result, layout = run_phase_with_recovery(
        phase_fn, data, selector=selector, phase=Phase.TRAIN, lengths=lengths, switch=switch, step=s
    )

``switch(layout)`` makes ``layout`` current (process groups, model weights, optimizer state);
``phase_fn(data, layout)`` runs the phase on ``data`` in it. The wrapper:

1. asks the selector for the phase's layout (``Selector.decide``: raises ``NoFeasibleLayout``
   before anything runs when no layout is predicted to fit);
2. switches to it and runs ``phase_fn``;
3. on ``torch.OutOfMemoryError`` (a CUDA OOM, or the CPU budget's ``BudgetExceeded``) marks that
   (phase, layout, length bucket) infeasible (``Selector.mark_infeasible``: never chosen again at
   that length or longer), takes the fastest remaining candidate predicted to fit that was not
   tried in this call, and re-runs ``phase_fn`` on the *same* ``data`` object: no sample is lost
   or truncated;
4. every candidate is tried at most once per call, so it always ends: when none is left it raises
   ``PhaseOutOfMemory`` naming the smallest layout and the memory it needs.

The phase must leave no partial effect when it raises an OOM (the train phase checks the budget
before ``optimizer.step``, ``MemoryBudget.guard_optimizer``), and every rank must see the OOM (a
CPU budget checkpoint is agreed over the world; a CUDA OOM on one rank is not, so keep the
safety margin that makes it rare). Which ranks call: every rank of the world, with the same
``lengths`` (decisions are deterministic).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_earl.parallel.layout import ParallelLayout
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
        try:
            result = phase_fn(data, layout)
        except torch.OutOfMemoryError as err:
            gc.collect()
            report.attempts.append((str(layout), f"OOM: {err}"))
            if getattr(err, "peak_bytes", None) is not None:
                report.oom_peaks[str(layout)] = err.peak_bytes
            selector.mark_infeasible(phase, layout, decision.stats.max)
            logger.warning("selector OOM step %d phase %s layout %s: %s", step, phase, layout, err)
            remaining = selector.next_candidates(decision, lengths, tried)
            if not remaining:
                raise PhaseOutOfMemory(_exhausted(selector, decision, lengths, report)) from err
            layout = remaining[0]
            selector.current[phase] = layout
            continue
        report.attempts.append((str(layout), "ok"))
        return result, report


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
