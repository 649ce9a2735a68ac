"""Calibrate the memory model against measured peaks of the real model, and report the error.

    points = measure(runner, [(layout, lengths), ...], phase=Phase.TRAIN)     # every rank calls
    settings = fit(memory_model, points)                                   # pure
    table = errors(MemoryModel(model, settings), points)                   # pure: per-point error

``measure`` runs the phase with ``PhaseRunner`` (warm-up run first, so Adam's state exists) and
records the measured peak: on CPU the project's own accounting (``MemoryBudget.track``: static
state + peak of live tensors created in the phase, max over ranks); on GPU the same code reads
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` instead.

``fit`` keeps the analytic structure and fits two constants per phase: ``activation_scale``
multiplies the analytic saved-activation bytes, ``fixed_bytes`` adds a constant (allocator
rounding, micro-batch metadata, the loss's per-token fp32 tensors). Least squares on the dynamic
part (measured peak minus the predicted static state, CP masks and log-prob buffers), weighted by
1 / measured so the *relative* error is minimised. The rollout phase has no CPU measurement and
keeps its analytic defaults (scale 1, fixed 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megatron_earl.config.vocab import Phase
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.memory import MemoryModel, MemorySettings, PhaseWorkload


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured phase run."""

    phase: str
    layout: str
    lengths: tuple[int, ...]
    """Sequence lengths of the whole batch."""
    token_budget: int
    """Tokens per micro-batch per DP replica before CP (``PhaseRunner.token_budget``)."""
    measured_bytes: int
    """Measured peak, max over ranks."""
    measured_static_bytes: int
    """Measured static state (the RL loop: max over ranks, so every rank saves the same point)."""
    train_layout: str | None = None
    """Where the trainable master copy lived during the run (the RL loop); None: in ``layout``
    (``MemoryModel.peak``'s ``train_layout``)."""

    def master_layout(self) -> ParallelLayout | None:
        return ParallelLayout.parse(self.train_layout) if self.train_layout else None

    def workload(self) -> PhaseWorkload:
        layout = ParallelLayout.parse(self.layout)
        return PhaseWorkload.for_lengths(
            self.phase, self.lengths, token_budget=self.token_budget, dp=layout.dp, cp=layout.cp
        )


def measure(
    runner, runs: Sequence[tuple[ParallelLayout, Sequence[int]]], phase: str = Phase.TRAIN
) -> list[CalibrationPoint]:
    """Run ``phase`` once per (layout, lengths) after a warm-up run; every rank calls."""
    from megatron_earl.selector.profile import synthetic_samples

    points = []
    for index, (layout, lengths) in enumerate(runs):
        runner.switch(layout)
        samples = synthetic_samples(lengths, runner.model.vocab_size, seed=index)
        runner.run(phase, samples)  # warm-up
        if torch.cuda.is_available():  # pragma: no cover - GPU path
            torch.cuda.reset_peak_memory_stats()
        result = runner.run(phase, samples)
        peak = result.peak_bytes
        if torch.cuda.is_available():  # pragma: no cover - GPU path
            peak = torch.cuda.max_memory_allocated()
        points.append(
            CalibrationPoint(
                phase,
                str(layout),
                tuple(lengths),
                runner.token_budget,
                peak,
                result.static_bytes,
            )
        )
    return points


def _split(
    memory: MemoryModel, point: CalibrationPoint, absorb_buffers: bool = False
) -> tuple[float, float]:
    """(analytic saved-activation bytes, dynamic bytes the fit must explain). With
    ``absorb_buffers`` the log-prob chunk buffers are left in the dynamic part (a per-layout
    fit, ``MemoryModel.logprob_buffers``)."""
    layout, work = ParallelLayout.parse(point.layout), point.workload()
    breakdown = memory.peak(point.phase, layout, work, point.master_layout())
    known = breakdown.static + breakdown.overhead + breakdown.kv_cache + breakdown.rotary_tables
    known += memory.cp_mask_bytes(point.phase, layout, work)
    stage = memory.peak_stage(point.phase, layout, work, buffers=not absorb_buffers)
    if stage == "last" and not absorb_buffers:
        known += memory.chunk_buffer_bytes(point.phase, layout, work)
    saved = memory.saved_activation_bytes(point.phase, layout, work, stage)
    return saved, point.measured_bytes - known


def _least_squares(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(scale, intercept) of y ~ scale * x + intercept over (x, y, measured) rows, weighted by
    1 / measured (relative error); a pure scale when x does not vary or the slope is not > 0."""
    x = [r[0] for r in rows]
    y = [r[1] for r in rows]
    w = [1.0 / r[2] for r in rows]
    if len(rows) == 1 or len(set(x)) == 1:
        return sum(y) / max(sum(x), 1e-9), 0.0
    sw = sum(wi * wi for wi in w)
    mx = sum(wi * wi * xi for wi, xi in zip(w, x, strict=True)) / sw
    my = sum(wi * wi * yi for wi, yi in zip(w, y, strict=True)) / sw
    sxx = sum(wi * wi * (xi - mx) ** 2 for wi, xi in zip(w, x, strict=True))
    sxy = sum(wi * wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(w, x, y, strict=True))
    scale = sxy / sxx
    if scale <= 0:  # degenerate data: fall back to a pure scale
        return sum(y) / sum(x), 0.0
    return scale, my - scale * mx


def fit(
    memory: MemoryModel,
    points: Sequence[CalibrationPoint],
    per_layout: bool = False,
    cache: dict | None = None,
) -> MemorySettings:
    """Settings with ``activation_scale`` and ``fixed_bytes`` fitted per measured phase; with
    ``per_layout``, also (scale, fixed) per (phase, layout) measured at two or more sizes
    (``MemorySettings.layout_fit``), the phase's constants covering the other layouts.
    ``cache`` (a dict the caller keeps, for one ``memory``) holds each point's analytic split,
    so re-fitting after every new point costs one split per new point."""
    base = replace(memory.settings, layout_fit={})
    plain = MemoryModel(memory.model, base)
    cache = {} if cache is None else cache

    def split(p: CalibrationPoint, absorb: bool) -> tuple[float, float, float]:
        if (p, absorb) not in cache:
            cache[(p, absorb)] = (*_split(plain, p, absorb), p.measured_bytes)
        return cache[(p, absorb)]

    rows: dict[str, list[tuple[float, float, float]]] = {}
    by_layout: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for p in points:
        rows.setdefault(p.phase, []).append(split(p, False))
        if per_layout:
            by_layout.setdefault((p.phase, p.layout), []).append(split(p, True))
    scales, fixed = {}, {}
    for phase, phase_rows in sorted(rows.items()):
        scales[phase], fixed[phase] = _least_squares(phase_rows)
    layout_fit = {
        f"{phase}/{layout}": _least_squares(mine)
        for (phase, layout), mine in sorted(by_layout.items())
        if len({round(r[0]) for r in mine}) >= 2
    }
    return base.with_calibration(scales, fixed, layout_fit)


@dataclass(frozen=True)
class CalibrationError:
    phase: str
    layout: str
    max_len: int
    predicted_bytes: float
    measured_bytes: int

    @property
    def relative(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def errors(memory: MemoryModel, points: Sequence[CalibrationPoint]) -> list[CalibrationError]:
    """Predicted vs measured peak of every point."""
    out = []
    for p in points:
        layout = ParallelLayout.parse(p.layout)
        predicted = memory.peak(p.phase, layout, p.workload(), p.master_layout()).total
        out.append(CalibrationError(p.phase, p.layout, max(p.lengths), predicted, p.measured_bytes))
    return out


def format_errors(rows: Sequence[CalibrationError]) -> str:
    lines = [f"{'phase':<11} {'layout':<14} {'max len':>7} {'pred MiB':>9} {'meas MiB':>9} err"]
    for r in rows:
        lines.append(
            f"{r.phase:<11} {r.layout:<14} {r.max_len:>7} {r.predicted_bytes / 2**20:>9.1f} "
            f"{r.measured_bytes / 2**20:>9.1f} {r.relative:+.1%}"
        )
    worst = max((abs(r.relative) for r in rows), default=0.0)
    lines.append(f"max |error| {worst:.1%} over {len(rows)} runs")
    return "\n".join(lines)
