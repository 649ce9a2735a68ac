"""Per-step layout selection inside the RL loop (``selector.enabled``; docs/selector.md).

    selection = PhaseSelection(config, world_size)
    lengths = gathered_lengths(batch.lengths)              # the same list on every rank
    result, layout, metrics = selection.run(
        Phase.EXPERIENCE, batch, lengths, phase_fn, switch=switch, static_bytes=static,
        train_layout=lambda: policy.train_layout, step=step,
    )

``run`` asks the phase's ``Selector`` for a layout (``NoFeasibleLayout`` before anything runs
when none fits the budget), switches to it and runs ``phase_fn(data, layout)`` under
``run_phase_with_recovery``: an out-of-budget run marks (layout, length bucket) infeasible and
re-runs the *same* data in the next candidate, so no sample is lost. The peak is measured per run:

- CPU: ``MemoryBudget.track`` (every tensor ATen creates, plus ``static_bytes(layout)``: the state
  the phase's memory model counts); the experience phase is checked at its end, the train phase
  before its optimizer step (``guard``), agreed over ranks: past ``selector.budget_mb`` every rank
  raises ``BudgetExceeded`` and the phase is retried. The accounting hooks every ATen op (several
  times slower on a tiny model), so a live run predicted below ``selector.measure_above`` x budget
  runs unmeasured (``cpu_measured``; the same answer on every rank);
- GPU: ``torch.cuda.max_memory_allocated`` (the allocator itself raises the OOM, on one rank:
  agreed over the ranks by ``run_phase_with_recovery``, see ``parallel/oom_agreement.py``).

Every measured run (start-up profiling, ``profile``, and live steps, OOM runs included) becomes a
``CalibrationPoint`` and the memory model is re-fitted (``calibrate.fit`` per phase and per
(phase, layout)), so the next prediction has seen this run. ``accuracy`` keeps every live run's
prediction made *before* it ran next to its measured peak. The rollout phase is predicted only on
CPU: the embedded engine computes in a worker thread that a dispatch mode does not see. The
phase's busy time (wall minus run-queue wait, min over ranks) refreshes the throughput table.
Candidates: experience, every layout of the world the model admits with dp <= samples per step;
train, dp <= samples per mini-batch; rollout, tp/dp only (the embedded engine needs pp = cp = 1),
dp <= prompts per step. The rollout phase counts the embedded engine's KV cache as the engine
allocates it, whole when it is built (``engine_kv``: rows x ``rollout.max_context``, the rows
its memory budget holds).

Which ranks call: every rank of the world, with the same lengths (decisions are deterministic).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.config.embedded import MAX_ENGINE_ROWS
from megatron_earl.config.run import RunConfig
from megatron_earl.config.vocab import Phase
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.layout import ParallelLayout, phase_layout
from megatron_earl.parallel.oom_agreement import agreement_point
from megatron_earl.selector.budget import BudgetExceeded, MemoryBudget
from megatron_earl.selector.calibrate import CalibrationPoint, fit
from megatron_earl.selector.decide import (
    NoFeasibleLayout,
    Selector,
    SelectorConfig,
    candidate_layouts,
    percentile,
)
from megatron_earl.selector.memory import (
    MemoryModel,
    MemorySettings,
    MiB,
    PhaseWorkload,
    ReservedKV,
    per_rank,
)
from megatron_earl.selector.oom import run_phase_with_recovery
from megatron_earl.selector.profile import BusyClock
from megatron_earl.selector.state import load_selector_state, selector_state
from megatron_earl.selector.throughput import HardwareSpec, Roofline, ThroughputTable


def phase_candidates(config: RunConfig, phase: str, world_size: int) -> list[ParallelLayout]:
    """The layouts ``phase`` may run in (module docstring)."""
    every = candidate_layouts(world_size, config.model)
    if phase == Phase.ROLLOUT:
        return [
            c for c in every if c.cp == 1 and c.pp == 1 and c.dp <= config.batch.prompts_per_step
        ]
    if phase == Phase.TRAIN:  # every replica needs a sample in every mini-batch
        per_mini_batch = config.batch.samples_per_step // config.batch.num_mini_batches
        return [c for c in every if c.dp <= per_mini_batch]
    return [c for c in every if c.dp <= config.batch.samples_per_step]


def cpu_measured(
    phase: str, predicted_bytes: float, budget_bytes: float, measure_above: float
) -> bool:
    """Whether a live CPU run of ``phase`` is measured (and so held to the budget and recorded):
    never the rollout (its engine computes in a worker thread the accounting does not see),
    otherwise when the run's predicted peak is at least ``measure_above`` x the budget. Pure."""
    return phase != Phase.ROLLOUT and predicted_bytes >= measure_above * budget_bytes


def engine_kv(config: RunConfig, device_bytes: float | None = None) -> ReservedKV:
    """The KV cache an embedded engine replica allocates when it is built, whatever the batch
    (``orchestration.engines.embedded.engine_config``): rows of ``rollout.max_context`` tokens,
    ``rollout.max_concurrency`` of them at most ``MAX_ENGINE_ROWS``, fewer when its budget holds
    fewer: ``rollout.embedded.kv_cache_mb``, or ``kv_memory_fraction`` x ``device_bytes`` less
    the layout's state (``ReservedKV.rows_for``); no budget on the CPU. The rollout phase is
    selected only with the embedded engine (``engines.checks``). Pure."""
    rollout = config.rollout
    settings = rollout.embedded
    kv = ReservedKV(min(rollout.max_concurrency, MAX_ENGINE_ROWS), rollout.max_context)
    if settings.kv_cache_mb is not None:
        return dataclasses.replace(kv, budget_bytes=settings.kv_cache_mb * MiB)
    if device_bytes is not None:
        share = settings.kv_memory_fraction * device_bytes
        return dataclasses.replace(kv, static_share_bytes=share)
    return kv


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
    # experience/train see the batch's own lengths (the rollout produced them): no
    # extrapolation; the rollout phase plans from the previous step's lengths, one step ahead,
    # with the engine's whole KV cache (on GPU sized from the budget, which stands for the
    # device's memory)
    kv = engine_kv(config, decide.budget_bytes if cuda else None)
    rollout = dataclasses.replace(decide, reserved_kv=kv)
    return {
        phase: Selector(
            config.model,
            world_size,
            rollout if phase == Phase.ROLLOUT else dataclasses.replace(decide, lookahead_steps=0.0),
            memory,
            table,
            phase_candidates(config, phase, world_size),
        )
        for phase in s.phases
    }


def selector_problems(config: RunConfig, world_size: int) -> list[str]:
    """Why the selector cannot run ``config`` at all: with the rollout phase selected, the
    embedded engine of ``layouts.rollout`` does not fit its budget (``_start_engine_problem``);
    its budget holds no layout even for the shortest batch (one-token sequences: the weights,
    train state and fixed buffers), or none for one sequence of ``rollout.max_context`` tokens
    (the longest a trajectory may grow to). Pure; the launchers call it before any process
    starts. Empty when the selector is off."""
    if not config.selector.enabled:
        return []
    problems = []
    if Phase.TRAIN in config.selector.phases and config.train.use_distributed_optimizer:
        problems.append(
            "selector.phases includes train, which moves the optimizer state between layouts; "
            "train.use_distributed_optimizer=true keeps it in flat DP shards that cannot move: "
            "set it to false or drop train from selector.phases"
        )
    try:
        selectors = build_selectors(config, world_size, runtime.policy().device.type == "cuda")
    except ValueError as err:
        return [f"selector: {err}"]
    budget_mb, margin = config.selector.budget_mb, config.selector.safety_margin
    engine = None
    if Phase.ROLLOUT in selectors:
        engine = _start_engine_problem(config, selectors[Phase.ROLLOUT])
    if engine is not None:  # it says why the rollout fits no layout: its KV cache
        problems.append(engine)
        selectors = {p: s for p, s in selectors.items() if p != Phase.ROLLOUT}
    shortest = [1] * config.batch.samples_per_step
    for phase, layouts, smallest, mib in _infeasible(selectors, shortest):
        problems.append(
            f"selector.budget_mb ({budget_mb:g} MiB) is too small: no {phase} layout of "
            f"{layouts} fits it (safety margin {margin:.0%}) even for the shortest batch; the "
            f"smallest is {smallest}, which needs {mib:.2f} MiB per rank (weights, train state "
            f"and the buffers of {len(shortest)} one-token sequences)"
        )
    if problems:
        return problems
    # a trajectory may grow to rollout.max_context: one such sequence must fit some layout
    # (necessary, not sufficient: the selector still decides per step on the real lengths)
    longest = [config.rollout.max_context] + [1] * (config.batch.samples_per_step - 1)
    for phase, layouts, smallest, mib in _infeasible(selectors, longest):
        problems.append(
            f"rollout.max_context ({config.rollout.max_context} tokens) does not fit "
            f"selector.budget_mb ({budget_mb:g} MiB, safety margin {margin:.0%}): "
            f"no {phase} layout of {layouts} holds one sequence of that length; the smallest "
            f"is {smallest}, which needs {mib:.2f} MiB per rank. Lower rollout.max_context, "
            "raise the budget, or give the selector layouts with more cp/tp"
        )
    return problems


def _start_engine_problem(config: RunConfig, selector: Selector) -> str | None:
    """Why the embedded engine of ``layouts.rollout`` does not fit the rollout ``selector``'s
    budget, or None. That engine is built when the run starts, before any decision (the warm
    start runs beside it, the first evaluation in it), and allocates its KV cache whole
    (``engine_kv``); checked with the weights, the train state in ``layouts.train`` and one
    sequence of ``rollout.max_context`` tokens. The message names the largest
    ``rollout.max_context`` that layout holds and the rollout layouts that hold this one. Pure."""
    start = phase_layout(config.layouts, Phase.ROLLOUT)
    train = phase_layout(config.layouts, Phase.TRAIN)
    limit = selector.config.budget_bytes / (1 + selector.config.safety_margin)
    kv = engine_kv(config)
    others = [1] * (config.batch.samples_per_step - 1)

    def peak(layout: ParallelLayout, context: int):
        work = PhaseWorkload.for_lengths(
            Phase.ROLLOUT,
            [context, *others],
            token_budget=selector.config.token_budget,
            dp=layout.dp,
            reserved_kv=dataclasses.replace(kv, context=context),
        )
        return selector.memory.peak(Phase.ROLLOUT, layout, work, train_layout=train)

    need = peak(start, kv.context)
    rows = round(need.kv_cache / selector.memory.kv_row_bytes(start, kv.context))
    if need.total <= limit:
        return None
    fits, too_long = 0, kv.context  # bisection: the peak grows with the context
    while too_long - fits > 1:
        mid = (fits + too_long) // 2
        fits, too_long = (mid, too_long) if peak(start, mid).total <= limit else (fits, mid)
    largest = (
        f"the largest rollout.max_context {start} holds is {fits}"
        if fits
        else f"no rollout.max_context fits {start}"
    )
    holders = [
        f"layouts.rollout={c} ({per_rank(p)})"
        for c in selector.candidates
        if c != start and (p := peak(c, kv.context).total) <= limit
    ]
    return (
        f"rollout.max_context ({kv.context} tokens) does not fit selector.budget_mb "
        f"({config.selector.budget_mb:g} MiB; {per_rank(limit)} with the safety margin "
        f"{config.selector.safety_margin:.0%}): the embedded engine of layouts.rollout {start} "
        "is built at start-up, before any layout decision, and allocates its KV cache whole, "
        f"{rows} rows (rollout.max_concurrency, at most {MAX_ENGINE_ROWS}) x {kv.context} "
        f"tokens = {per_rank(need.kv_cache)}; with the weights, the train state and one "
        f"sequence of that length it needs {per_rank(need.total)}. Fits: {largest}"
        + "".join(f"; {h} holds {kv.context}" for h in holders)
        + "; or a smaller rollout.max_concurrency, or a larger selector.budget_mb"
    )


def _infeasible(selectors: dict, lengths: list[int]) -> list[tuple[str, list[str], str, float]]:
    """(phase, candidate layouts, the smallest one, its predicted peak in MiB) of every phase
    whose selector finds no layout for a batch of ``lengths``. Pure."""
    out = []
    for phase, selector in selectors.items():
        try:
            selector.decide(phase, lengths)
        except NoFeasibleLayout:
            peaks = {
                str(c): selector.predicted_peak(phase, c, lengths) for c in selector.candidates
            }
            smallest = min(peaks, key=peaks.get)
            out.append((phase, list(peaks), smallest, peaks[smallest] / MiB))
    return out


def gathered_lengths(local: Sequence[int]) -> list[int]:
    """Every rank's sequence lengths, concatenated in rank order (small metadata). Collective
    (world; on the host world group)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, [int(n) for n in local], group=host_group())
    return [n for part in out for n in part]


class PhaseSelection:
    """The selectors, the budget, the measurements and the online calibration of the selected
    phases (module docstring)."""

    def __init__(self, config: RunConfig, world_size: int) -> None:
        self.config = config
        self.cuda = runtime.policy().device.type == "cuda"
        self.selectors = build_selectors(config, world_size, self.cuda)
        limit = int(config.selector.budget_mb * MiB)
        self.budget = None if self.cuda else MemoryBudget(limit)
        self.memory: MemoryModel = next(iter(self.selectors.values())).memory
        self.base_settings = self.memory.settings
        self.points: list[CalibrationPoint] = []
        """Every measured run of a selected phase (start-up profiling and live steps)."""
        self.measure_above = config.selector.measure_above
        self._enforcing = False
        self._splits: dict = {}
        self.accuracy: list[tuple[str, str, int, float, int]] = []
        """(phase, layout, longest, predicted before the run, measured) of every live run."""

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self.selectors)

    def guard(self, optimizer: Any) -> Any:
        """``optimizer`` whose ``step`` first checks the CPU budget while a measured phase runs
        (an over-budget train phase applies no update); ``optimizer`` itself otherwise."""
        if self._enforcing:  # only inside an enforced CPU ``track`` block (``_measure``)
            return self.budget.guard_optimizer(optimizer)
        return optimizer

    def state(self) -> dict:
        """The selectors' state, calibration points included (JSON-able; ``selector.state``)."""
        return selector_state(self.selectors, self.points)

    def restore(self, state: dict) -> None:
        """Continue from ``state`` (a resumed run): decisions, OOM marks, throughput cells,
        calibrated memory model and its points. Raises ``ValueError`` (restoring nothing) when
        the state does not fit this run's selectors."""
        self.points = load_selector_state(self.selectors, state)

    # ------------------------------------------------------------------ calibration

    def record(
        self,
        phase: str,
        layout: ParallelLayout,
        lengths: Sequence[int],
        peak: float,
        static: int,
        train_layout: ParallelLayout,
    ) -> None:
        """Add one measured run and re-fit the memory model's constants (per phase and per
        (phase, layout) measured at two sizes or more). Pure given its inputs (same on every
        rank: peaks are agreed)."""
        if math.isnan(peak):
            return
        self.points.append(
            CalibrationPoint(
                phase,
                str(layout),
                tuple(int(n) for n in lengths),
                self.config.batch.max_tokens_per_micro_batch,
                int(peak),
                int(static),
                train_layout=str(train_layout),
            )
        )
        self.refit()

    def refit(self) -> None:
        base = MemoryModel(self.memory.model, self.base_settings)
        self.memory.settings = fit(base, self.points, per_layout=True, cache=self._splits)

    def profile(
        self,
        phase: str,
        layout: ParallelLayout,
        lengths: Sequence[int],
        fn: Callable[[], Any],
        *,
        static: int,
        train_layout: ParallelLayout,
        record: bool = True,
    ) -> tuple[float, float]:
        """Run ``fn`` (a start-up profiling run of ``phase`` in the active ``layout``) measured
        but never refused; record its peak and tokens/s. Returns (peak bytes, busy seconds).
        Collective (world)."""
        agreed = _agreed_max(static)  # this rank's ``static`` is measured; the point keeps the max
        seconds, (_, peak) = self._timed(lambda: self._measure(phase, fn, static, enforce=False))
        if record:
            self.record(phase, layout, lengths, peak, agreed, train_layout)
            if seconds > 0:
                self.selectors[phase].table.record(
                    phase, layout, percentile(lengths, 0.95), sum(lengths), seconds
                )
        return peak, seconds

    # ------------------------------------------------------------------ one phase

    def run(
        self,
        phase: str,
        data: Any,
        lengths: Sequence[int],
        phase_fn: Callable[[Any, ParallelLayout], Any],
        *,
        switch: Callable[[ParallelLayout], None],
        static_bytes: Callable[[ParallelLayout], int],
        train_layout: Callable[[], ParallelLayout],
        step: int,
    ) -> tuple[Any, ParallelLayout, dict[str, float | str]]:
        """Decide, switch and run ``phase_fn`` with OOM recovery; returns its result, the layout
        it ran in and the step metrics of the decision. ``train_layout()`` is where the master
        copy is (the experience phase's memory includes it). Every rank calls."""
        selector = self.selectors[phase]
        selector.train_layout = None if phase == Phase.TRAIN else train_layout()
        runs: dict[str, tuple[float, float]] = {}  # layout -> (predicted, measured) of its run
        seconds = [0.0]

        def measured(batch: Any, layout: ParallelLayout) -> Any:
            predicted = selector.predicted_peak(phase, layout, lengths)
            measure = self.cuda or cpu_measured(
                phase, predicted, self.config.selector.budget_mb * MiB, self.measure_above
            )
            static = static_bytes(layout)  # this rank's; the calibration point keeps the max
            agreed = _agreed_max(static) if measure else static
            home = layout if phase == Phase.TRAIN else train_layout()
            try:
                busy, (result, peak) = self._timed(
                    lambda: self._measure(
                        phase, lambda: phase_fn(batch, layout), static, measure=measure
                    )
                )
            except BudgetExceeded as err:  # measured, agreed: a calibration point too
                self._note(phase, layout, lengths, predicted, err.peak_bytes, agreed, home)
                raise
            runs[str(layout)] = (predicted, peak)
            seconds[0] = busy
            self._note(phase, layout, lengths, predicted, peak, agreed, home)
            return result

        switch_s = [0.0]

        def timed_switch(layout: ParallelLayout) -> None:
            start = time.perf_counter()
            switch(layout)
            switch_s[0] += time.perf_counter() - start

        result, report = run_phase_with_recovery(
            measured,
            data,
            selector=selector,
            phase=phase,
            lengths=lengths,
            switch=timed_switch,
            step=step,
        )
        layout, decision = report.layout, report.decision
        if seconds[0] > 0:
            selector.table.record(phase, layout, decision.stats.p95, sum(lengths), seconds[0])
        predicted, peak = runs[str(layout)]
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
            f"{prefix}/switch_s": switch_s[0],
        }
        if not math.isnan(peak):  # rollout on CPU is not measured
            metrics[f"{prefix}/measured_mb"] = peak / MiB
        return result, layout, metrics

    def _note(self, phase, layout, lengths, predicted, peak, static, home) -> None:
        if not math.isnan(peak):
            self.accuracy.append((phase, str(layout), max(lengths), predicted, int(peak)))
        self.record(phase, layout, lengths, peak, static, home)

    @staticmethod
    def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        """(busy seconds, fn()): ``BusyClock``'s busy time, min over ranks. Collective
        (world)."""
        clock = BusyClock()
        with clock("run"):
            out = fn()
        return clock.min_busy()["run"], out

    def _measure(
        self,
        phase: str,
        fn: Callable[[], Any],
        static: int,
        enforce: bool = True,
        measure: bool = True,
    ) -> tuple[Any, float]:
        """Run ``fn`` and return its result and the peak (max over ranks; nan where not
        measured: ``measure`` false on CPU, the rollout on CPU). CPU: past the budget every rank
        raises ``BudgetExceeded`` (the train phase checks before its optimizer step, ``guard``;
        at its end the peak is only read). Before the peak's all-reduce, an OOM agreement point
        (``parallel.oom_agreement``). Collective (world; every rank with the same ``measure``)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            result = fn()
            agreement_point()  # an OOM on another rank in the phase: raise here, in step
            peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cpu")
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=host_group())
            return result, float(peak[0])
        if phase == Phase.ROLLOUT or not measure:  # rollout: the engine's worker thread
            return fn(), math.nan
        self._enforcing = enforce
        try:
            with self.budget.track(static_bytes=static):
                result = fn()
        finally:
            self._enforcing = False
        if enforce and phase != Phase.TRAIN:
            return result, float(self.budget.checkpoint())  # an OOM agreement point first
        agreement_point()
        return result, float(self.budget.agreed_peak())


def _agreed_max(value: int) -> int:
    """``value``, max over the world: a run's static state differs per rank (pipeline stages),
    and the calibration points saved in checkpoints must be the same on every rank. Collective
    (world; on the host world group)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device="cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return int(t.item())
