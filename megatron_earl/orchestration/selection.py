"""Per-step layout selection inside the RL loop (``selector.enabled``; docs/selector.md).

    selection = PhaseSelection(config, world_size)
    lengths = gathered_lengths(batch.lengths)              # the same list on every rank
    result, layout, metrics = selection.run(
        "experience", batch, lengths, phase_fn, switch=switch, static_bytes=static, step=step
    )

``run`` asks the phase's ``Selector`` for a layout (``NoFeasibleLayout`` before anything runs
when none fits the budget), switches to it and runs ``phase_fn(data, layout)`` under
``run_phase_with_recovery``: an out-of-budget run marks (layout, length bucket) infeasible and
re-runs the *same* data in the next candidate, so no sample is lost. The peak is measured per run:

- CPU: ``MemoryBudget.track`` (every tensor ATen creates, plus ``static_bytes(layout)``: the state
  the phase's memory model counts) and an agreed ``checkpoint`` at the phase's end: past
  ``selector.budget_mb`` every rank raises ``BudgetExceeded`` and the phase is retried;
- GPU: ``torch.cuda.max_memory_allocated`` (the allocator itself raises the OOM).

The rollout phase is predicted only on CPU: the embedded engine computes in a worker thread that a
dispatch mode does not see. The phase's time (max over ranks) refreshes the throughput table.
Experience candidates: every layout of the world the model admits with dp <= samples per step;
rollout candidates: tp/dp only (the embedded engine needs pp = cp = 1), dp <= prompts per step.

Which ranks call: every rank of the world, with the same lengths (decisions are deterministic).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_earl.config.run import RunConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.budget import MemoryBudget
from megatron_earl.selector.decide import (
    NoFeasibleLayout,
    Selector,
    SelectorConfig,
    candidate_layouts,
)
from megatron_earl.selector.memory import MemoryModel, MemorySettings, MiB
from megatron_earl.selector.oom import run_phase_with_recovery
from megatron_earl.selector.throughput import HardwareSpec, Roofline, ThroughputTable


def phase_candidates(config: RunConfig, phase: str, world_size: int) -> list[ParallelLayout]:
    """The layouts ``phase`` may run in (module docstring)."""
    every = candidate_layouts(world_size, config.model)
    if phase == "rollout":
        return [
            c for c in every if c.cp == 1 and c.pp == 1 and c.dp <= config.batch.prompts_per_step
        ]
    return [c for c in every if c.dp <= config.batch.samples_per_step]


def build_selectors(config: RunConfig, world_size: int, cuda: bool) -> dict[str, Selector]:
    """One ``Selector`` per selected phase, sharing the memory model and throughput table. Pure."""
    s = config.selector
    memory = MemoryModel(config.model, MemorySettings.gpu() if cuda else MemorySettings.cpu())
    hardware = HardwareSpec.h100() if cuda else HardwareSpec.cpu()
    table = ThroughputTable(Roofline(config.model, hardware, config.model.recompute_granularity))
    decide = SelectorConfig(
        budget_bytes=s.budget_mb * MiB,
        safety_margin=s.safety_margin,
        switch_gain=s.switch_gain,
        token_budget=config.batch.max_tokens_per_micro_batch,
    )
    return {
        phase: Selector(
            config.model,
            world_size,
            decide,
            memory,
            table,
            phase_candidates(config, phase, world_size),
        )
        for phase in s.phases
    }


def selector_problems(config: RunConfig, world_size: int) -> list[str]:
    """Why the selector cannot run ``config`` at all: its budget holds no layout even for the
    shortest batch (one-token sequences: the weights, train state and fixed buffers).
    Pure; the launchers call it before any process starts. Empty when the selector is off."""
    if not config.selector.enabled:
        return []
    problems = []
    try:
        selectors = build_selectors(config, world_size, torch.cuda.is_available())
    except ValueError as err:
        return [f"selector: {err}"]
    shortest = [1] * config.batch.samples_per_step
    for phase, selector in selectors.items():
        try:
            selector.decide(phase, shortest)
        except NoFeasibleLayout:
            peaks = {
                str(c): selector.predicted_peak(phase, c, shortest) for c in selector.candidates
            }
            smallest = min(peaks, key=peaks.get)
            problems.append(
                f"selector.budget_mb ({config.selector.budget_mb:g} MiB) is too small: no "
                f"{phase} layout of {list(peaks)} fits it (safety margin "
                f"{config.selector.safety_margin:.0%}) even for the shortest batch; the smallest "
                f"is {smallest}, which needs {peaks[smallest] / MiB:.2f} MiB per rank (weights, "
                f"train state and the buffers of {len(shortest)} one-token sequences)"
            )
    return problems


def gathered_lengths(local: Sequence[int]) -> list[int]:
    """Every rank's sequence lengths, concatenated in rank order (small metadata). Collective
    (world)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, [int(n) for n in local])
    return [n for part in out for n in part]


class PhaseSelection:
    """The selectors, the budget and the measurement of the selected phases (module docstring)."""

    def __init__(self, config: RunConfig, world_size: int) -> None:
        self.cuda = torch.cuda.is_available()
        self.selectors = build_selectors(config, world_size, self.cuda)
        limit = int(config.selector.budget_mb * MiB)
        self.budget = None if self.cuda else MemoryBudget(limit)

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self.selectors)

    def current(self, phase: str) -> ParallelLayout | None:
        """The layout ``phase`` last ran in (None before its first decision)."""
        return self.selectors[phase].current.get(phase)

    def run(
        self,
        phase: str,
        data: Any,
        lengths: Sequence[int],
        phase_fn: Callable[[Any, ParallelLayout], Any],
        *,
        switch: Callable[[ParallelLayout], None],
        static_bytes: Callable[[ParallelLayout], int],
        step: int,
    ) -> tuple[Any, ParallelLayout, dict[str, float | str]]:
        """Decide, switch and run ``phase_fn`` with OOM recovery; returns its result, the layout
        it ran in and the step metrics of the decision. Every rank calls."""
        selector = self.selectors[phase]
        peaks: dict[str, float] = {}

        def measured(batch: Any, layout: ParallelLayout) -> Any:
            start = time.perf_counter()
            result, peak = self._measure(
                phase, lambda: phase_fn(batch, layout), layout, static_bytes
            )
            peaks[str(layout)] = peak
            seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            peaks["seconds"] = float(seconds[0])
            return result

        result, report = run_phase_with_recovery(
            measured,
            data,
            selector=selector,
            phase=phase,
            lengths=lengths,
            switch=switch,
            step=step,
        )
        layout, decision = report.layout, report.decision
        if peaks["seconds"] > 0:
            selector.table.record(phase, layout, decision.stats.p95, sum(lengths), peaks["seconds"])
        predicted = selector.predicted_peak(phase, layout, lengths, decision.stats.planned)
        prefix = f"selector/{phase}"
        metrics: dict[str, float | str] = {
            f"layout/{phase}": str(layout),
            f"{prefix}/reason": decision.reason,
            f"{prefix}/decided": str(decision.layout),
            f"{prefix}/attempts": ",".join(
                f"{name}:{'ok' if o == 'ok' else 'OOM'}" for name, o in report.attempts
            ),
            f"{prefix}/ooms": float(report.num_ooms),
            f"{prefix}/switched": float(
                str(decision.previous) != str(layout) and decision.previous is not None
            ),
            f"{prefix}/max_len": float(decision.stats.max),
            f"{prefix}/planned_len": float(decision.stats.planned),
            f"{prefix}/predicted_mb": predicted / MiB,
        }
        if not math.isnan(peaks.get(str(layout), math.nan)):  # rollout on CPU is not measured
            metrics[f"{prefix}/measured_mb"] = peaks[str(layout)] / MiB
        return result, layout, metrics

    def _measure(
        self,
        phase: str,
        fn: Callable[[], Any],
        layout: ParallelLayout,
        static_bytes: Callable[[ParallelLayout], int],
    ) -> tuple[Any, float]:
        """Run ``fn`` and return its result and the peak (max over ranks; nan where not measured).
        CPU: past the budget every rank raises ``BudgetExceeded``. Collective (world)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            result = fn()
            peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            return result, float(peak[0])
        if phase == "rollout":  # the engine computes in a worker thread: not measured on CPU
            return fn(), math.nan
        with self.budget.track(static_bytes=static_bytes(layout)):
            result = fn()
        return result, float(self.budget.checkpoint())
