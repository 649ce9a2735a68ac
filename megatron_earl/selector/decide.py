"""The decision: before each phase, the highest-throughput layout predicted to fit, with hysteresis.

    selector = Selector(model, world_size=32, budget_bytes=80 * GiB, memory=..., table=...)
    decision = selector.decide(Phase.TRAIN, lengths, step=12)     # -> Decision (also logged)
    use_layout(decision.layout); ...

Rule, per phase:

1. Statistics of the batch's sequence lengths: p50, p95, max, and the trend of the max over the
   last ``trend_window`` decisions of that phase (least-squares slope per step). The length the
   memory check uses is ``max(max, max + slope * lookahead)``: a growing context moves to a layout
   that fits *before* the step that would not (when no layout holds that extrapolated length, the
   batch's own max is used: the trend is advisory, the batch must run).
2. Candidates: every (tp, cp, pp, dp) of the world size the model admits
   (``ParallelLayout.problems``), vpp off, minus those marked infeasible for this length bucket
   (an OOM there, ``mark_infeasible``). A candidate fits when its predicted peak times
   ``1 + safety_margin`` is within the budget.
3. Among those that fit, the highest predicted tokens/s at the p95 bucket (``ThroughputTable``).
4. Hysteresis: the phase's current layout is kept while it fits unless the best is faster by more
   than ``switch_gain`` (relative).

No candidate fits -> ``NoFeasibleLayout`` before the phase runs, naming the layout with the
smallest predicted peak and the memory it needs. Every decision is a ``Decision`` record, logged
as JSON on the ``megatron_earl.selector`` logger and kept in ``Selector.log``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import PHASES
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.memory import MemoryModel, PhaseWorkload, ReservedKV, per_rank
from megatron_earl.selector.throughput import ThroughputTable, bucket_of

logger = logging.getLogger("megatron_earl.selector")


class NoFeasibleLayout(RuntimeError):
    """No layout of the world fits the memory budget for this phase's batch."""


@dataclass(frozen=True)
class SelectorConfig:
    """How the selector decides."""

    budget_bytes: float
    """Device memory per rank the phases may use."""
    safety_margin: float = 0.1
    """A layout fits when predicted peak x (1 + margin) <= budget."""
    switch_gain: float = 0.1
    """Leave a layout that still fits only for a predicted speed-up above this (relative)."""
    trend_window: int = 4
    """Recent decisions of a phase used for the length trend."""
    lookahead_steps: float = 1.0
    """Steps ahead the memory check extrapolates the growth of the longest sequence."""
    token_budget: int = 8192
    """Tokens per micro-batch per DP replica (before CP); a longer sequence gets its own."""
    concurrent_sequences: int | None = None
    """Rollout: sequences per engine replica (None: the batch spread over dp)."""
    reserved_kv: ReservedKV | None = None
    """Rollout: the engine's KV cache when it is allocated whole up front (the embedded engine's
    rows x ``rollout.max_context``, whatever the batch); None: sized by the batch."""

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {self.budget_bytes}")
        if not 0 <= self.safety_margin < 1:
            raise ValueError(f"safety_margin must be in [0, 1), got {self.safety_margin}")
        if self.switch_gain < 0:
            raise ValueError(f"switch_gain must be >= 0, got {self.switch_gain}")
        if self.trend_window < 1 or self.token_budget < 1:
            raise ValueError(
                f"trend_window ({self.trend_window}) and token_budget ({self.token_budget}) "
                "must be >= 1"
            )


@dataclass(frozen=True)
class LengthStats:
    """The batch's context lengths as the decision sees them."""

    p50: int
    p95: int
    max: int
    slope: float
    """Growth of the max length per step over the recent window (tokens / step)."""
    planned: int
    """Length the memory check uses: max extrapolated ``lookahead_steps`` ahead (>= max)."""


@dataclass(frozen=True)
class Candidate:
    layout: str
    fits: bool
    peak_bytes: float
    tokens_per_s: float
    source: str
    """"measured", "roofline", or "infeasible" (an OOM marked it)."""


@dataclass(frozen=True)
class Decision:
    """One structured decision record."""

    step: int
    phase: str
    layout: ParallelLayout
    previous: ParallelLayout | None
    reason: str
    """"initial", "best", "keep (hysteresis)", "current does not fit", "current infeasible"."""
    stats: LengthStats
    peak_bytes: float
    tokens_per_s: float
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def switched(self) -> bool:
        return self.previous is not None and self.previous != self.layout

    def to_json(self) -> str:
        record = asdict(self)
        record["layout"], record["previous"] = str(self.layout), str(self.previous)
        return json.dumps(record)


def percentile(values: Sequence[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def candidate_layouts(world_size: int, model: ModelConfig) -> list[ParallelLayout]:
    """Every (tp, cp, pp, dp) with product ``world_size`` the model admits (vpp off)."""
    out = []
    for tp in _divisors(world_size):
        for cp in _divisors(world_size // tp):
            for pp in _divisors(world_size // (tp * cp)):
                layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=world_size // (tp * cp * pp))
                if not layout.problems(world_size, model, pad_sequences=True):
                    out.append(layout)
    return out


class Selector:
    """Chooses each phase's layout before it runs (module docstring)."""

    def __init__(
        self,
        model: ModelConfig,
        world_size: int,
        config: SelectorConfig,
        memory: MemoryModel,
        table: ThroughputTable,
        candidates: Sequence[ParallelLayout] | None = None,
    ) -> None:
        self.model, self.config, self.memory, self.table = model, config, memory, table
        self.candidates = list(candidates or candidate_layouts(world_size, model))
        bad = [str(c) for c in self.candidates if c.problems(world_size, model, pad_sequences=True)]
        if not self.candidates or bad:
            raise ValueError(
                f"candidates {bad or '[]'} are not valid layouts of world size {world_size} for "
                f"this model; valid: {[str(c) for c in candidate_layouts(world_size, model)]}"
            )
        self.current: dict[str, ParallelLayout] = {}
        self.train_layout: ParallelLayout | None = None
        """Where the trainable master copy lives while rollout/experience run (the RL loop sets
        it before deciding); None: each candidate holds its own (``MemoryModel.peak``)."""
        self.infeasible: set[tuple[str, str, int]] = set()
        self.history: dict[str, list[int]] = {p: [] for p in PHASES}
        self.log: list[Decision] = []

    # ------------------------------------------------------------------ inputs

    def stats(self, phase: str, lengths: Sequence[int]) -> LengthStats:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"lengths must be a non-empty list of positive ints, got {lengths}")
        recent = [*self.history[phase][-(self.config.trend_window - 1) :], max(lengths)]
        slope = _slope(recent)
        longest = max(lengths)
        planned = max(longest, math.ceil(longest + slope * self.config.lookahead_steps))
        return LengthStats(
            percentile(lengths, 0.5), percentile(lengths, 0.95), longest, slope, planned
        )

    def workload(self, phase: str, layout: ParallelLayout, lengths: Sequence[int], planned: int):
        scaled = [*sorted(lengths)[:-1], planned]  # the longest grown to the planned length
        return PhaseWorkload.for_lengths(
            phase,
            scaled,
            token_budget=self.config.token_budget,
            dp=layout.dp,
            cp=layout.cp,
            concurrent_sequences=self.config.concurrent_sequences,
            reserved_kv=self.config.reserved_kv,
        )

    def predicted_peak(
        self, phase: str, layout: ParallelLayout, lengths: Sequence[int], planned: int | None = None
    ) -> float:
        work = self.workload(phase, layout, lengths, planned or max(lengths))
        return self.memory.peak(phase, layout, work, self.train_layout).total

    def mark_infeasible(self, phase: str, layout: ParallelLayout, length: int) -> None:
        """An OOM ran ``layout`` out of memory at ``length``: never choose it again for this
        phase at that bucket or a longer one."""
        self.infeasible.add((phase, str(layout), bucket_of(length)))

    def is_infeasible(self, phase: str, layout: ParallelLayout, length: int) -> bool:
        bucket = bucket_of(length)
        return any(
            p == phase and name == str(layout) and b <= bucket for p, name, b in self.infeasible
        )

    # ------------------------------------------------------------------ decision

    def rank(self, phase: str, lengths: Sequence[int], stats: LengthStats) -> list[Candidate]:
        """Every candidate with its prediction, fitting ones first by tokens/s descending."""
        limit = self.config.budget_bytes / (1 + self.config.safety_margin)
        out = []
        for layout in self.candidates:
            peak = self.predicted_peak(phase, layout, lengths, stats.planned)
            speed, source = self.table.predict(phase, layout, stats.p95)
            infeasible = self.is_infeasible(phase, layout, stats.planned)
            fits = peak <= limit and not infeasible
            out.append(
                Candidate(str(layout), fits, peak, speed, "infeasible" if infeasible else source)
            )
        out.sort(key=lambda c: (not c.fits, -c.tokens_per_s if c.fits else c.peak_bytes))
        return out

    def decide(self, phase: str, lengths: Sequence[int], step: int = 0) -> Decision:
        """The layout for ``phase`` on this batch; raises ``NoFeasibleLayout`` when none fits.

        Pure and deterministic: every rank computes the same decision from the same lengths.
        """
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        stats = self.stats(phase, lengths)
        ranked = self.rank(phase, lengths, stats)
        if not ranked[0].fits and stats.planned > stats.max:
            # the trend is advisory: when nothing holds the extrapolated length, plan for the
            # batch as it is (it must run, untruncated)
            stats = dataclasses.replace(stats, planned=stats.max)
            ranked = self.rank(phase, lengths, stats)
        if not ranked[0].fits:
            smallest = min(ranked, key=lambda c: c.peak_bytes)
            raise NoFeasibleLayout(
                f"{phase}: no layout of {len(ranked)} candidates fits the budget "
                f"{per_rank(self.config.budget_bytes)} (margin "
                f"{self.config.safety_margin:.0%}) for a longest sequence of {stats.planned} "
                f"tokens; the smallest is {smallest.layout}, which needs "
                f"{per_rank(smallest.peak_bytes)}"
                + (" (marked infeasible after an OOM)" if smallest.source == "infeasible" else "")
            )
        best = ranked[0]
        previous = self.current.get(phase)
        chosen, reason = best, "best"
        if previous is None:
            reason = "initial"
        elif str(previous) != best.layout:
            cur = next(c for c in ranked if c.layout == str(previous))
            if cur.fits and best.tokens_per_s <= cur.tokens_per_s * (1 + self.config.switch_gain):
                chosen, reason = cur, "keep (hysteresis)"
            elif not cur.fits:
                reason = (
                    "current infeasible" if cur.source == "infeasible" else "current does not fit"
                )
        layout = ParallelLayout.parse(chosen.layout)
        decision = Decision(
            step=step,
            phase=phase,
            layout=layout,
            previous=previous,
            reason=reason,
            stats=stats,
            peak_bytes=chosen.peak_bytes,
            tokens_per_s=chosen.tokens_per_s,
            candidates=ranked,
        )
        self.current[phase] = layout
        self.history[phase].append(stats.max)
        self.log.append(decision)
        logger.info("selector decision %s", decision.to_json())
        return decision

    def next_candidates(
        self, decision: Decision, lengths: Sequence[int], tried: Sequence[ParallelLayout]
    ) -> list[ParallelLayout]:
        """Layouts predicted to fit and not yet tried or marked infeasible, fastest first."""
        names = {str(t) for t in tried}
        return [
            ParallelLayout.parse(c.layout)
            for c in self.rank(decision.phase, lengths, decision.stats)
            if c.fits and c.layout not in names
        ]


def _slope(values: Sequence[int]) -> float:
    """Least-squares slope of ``values`` against their index (0 for fewer than 2)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
