"""Calibrate the memory model against measured peaks of the real model, and report the error.

    points = measure(runner, [(layout, lengths), ...], phase="train")     # every rank calls
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
from dataclasses import dataclass

import torch

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
    """Measured static state on that rank."""

    def workload(self) -> PhaseWorkload:
        layout = ParallelLayout.parse(self.layout)
        return PhaseWorkload.for_lengths(
            self.phase, self.lengths, token_budget=self.token_budget, dp=layout.dp
        )


def measure(
    runner, runs: Sequence[tuple[ParallelLayout, Sequence[int]]], phase: str = "train"
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


def _split(memory: MemoryModel, point: CalibrationPoint) -> tuple[float, float]:
    """(analytic saved-activation bytes, dynamic bytes the fit must explain)."""
    layout, work = ParallelLayout.parse(point.layout), point.workload()
    breakdown = memory.peak(point.phase, layout, work)
    known = breakdown.static + breakdown.overhead + breakdown.kv_cache
    known += memory.cp_mask_bytes(point.phase, layout, work)
    stage = "last"
    if breakdown.logprob_buffers:  # the last stage holds the peak: its chunk buffers are known
        known += memory.chunk_buffer_bytes(point.phase, layout, work)
    else:
        stage = "first"
    saved = memory.saved_activation_bytes(point.phase, layout, work, stage)
    return saved, point.measured_bytes - known


def fit(memory: MemoryModel, points: Sequence[CalibrationPoint]) -> MemorySettings:
    """Settings with ``activation_scale`` and ``fixed_bytes`` fitted per measured phase."""
    scales, fixed = {}, {}
    for phase in sorted({p.phase for p in points}):
        rows = [(_split(memory, p), p.measured_bytes) for p in points if p.phase == phase]
        w = [1.0 / m for _, m in rows]
        x = [a for (a, _), _ in rows]
        y = [b for (_, b), _ in rows]
        if len(rows) == 1 or len(set(x)) == 1:
            scales[phase], fixed[phase] = sum(y) / max(sum(x), 1e-9), 0.0
            continue
        sw = sum(wi * wi for wi in w)
        mx = sum(wi * wi * xi for wi, xi in zip(w, x, strict=True)) / sw
        my = sum(wi * wi * yi for wi, yi in zip(w, y, strict=True)) / sw
        sxx = sum(wi * wi * (xi - mx) ** 2 for wi, xi in zip(w, x, strict=True))
        sxy = sum(wi * wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(w, x, y, strict=True))
        scale = sxy / sxx
        if scale <= 0:  # degenerate data: fall back to a pure scale
            scale, intercept = sum(y) / sum(x), 0.0
        else:
            intercept = my - scale * mx
        scales[phase], fixed[phase] = scale, intercept
    return memory.settings.with_calibration(scales, fixed)


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
        predicted = memory.peak(p.phase, ParallelLayout.parse(p.layout), p.workload()).total
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
