"""What ``bench engine`` measures and what it reports (``bench/engine.py`` says how): the
settings (``EngineBenchConfig``), the agreement check, one ``BenchRow`` per engine, batch size and
sampling mode, the paired ours/HF ratios and the whole result. Read by the measuring loop
(``bench/engine_driver.py``) and the command (``bench/engine.py``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from megatron_earl.config.embedded import COMPILE_SWITCHES
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import EngineKind

SAMPLING_MODES = ("greedy", "sampled")
"""Greedy (temperature 0) and plain temperature-1 sampling."""
ENGINES = (EngineKind.EMBEDDED.value, "hf")
"""Ours and ``transformers`` ``generate``."""


@dataclass(frozen=True)
class EngineBenchConfig:
    """What ``bench engine`` measures."""

    model: ModelConfig
    """The model (default: the demo model of configs/demo_cpu.yaml)."""
    batches: tuple[int, ...] = (64,)
    """Batch sizes (concurrent requests) to measure, in order."""
    prompt_len: int = 32
    """Prompt tokens of every request."""
    new_tokens: int = 48
    """Tokens every request generates (the demo's per-turn limit)."""
    repeats: int = 5
    """Interleaved rounds per batch size and sampling mode; medians are reported."""
    tp: int = 1
    """Tensor-parallel processes of our engine (HF always runs in one process)."""
    agree_tokens: int = 8
    """First greedy tokens per request compared between the two engines."""
    group_size: int = 1
    """Requests sharing one prompt (1: every prompt distinct; 8: a GRPO group, as RL samples
    8 completions per prompt -- our engine prefills a group's prompt once, HF every row)."""
    seed: int = 0
    """Seed of the weights, the prompts and our engine's sampling stream."""
    compile_decode: bool = False
    """Our engine's ``EmbeddedEngineConfig.compile_decode`` (``torch.compile`` of the decode
    step; its compilation happens in the untimed warm-up and is reported as ``ours_warmup_s``)."""
    compile_prefill: bool = False
    """Our engine's ``EmbeddedEngineConfig.compile_prefill`` (``torch.compile`` of prefill
    steps up to ``PREFILL_COMPILE_MAX_SCORES``; compiled in the same warm-up)."""
    decode_threads: int = 1
    """Our engine's ``EmbeddedEngineConfig.decode_threads`` (the engine's default here): torch
    threads of its decode steps (0: the prefill's, i.e. every core, as HF gets)."""
    step_thread: bool = False
    """Our engine's ``EmbeddedEngineConfig.step_thread``. Off by default: HF runs in this
    process's main thread, and our worker thread's own OpenMP team next to HF's slows every
    parallel op of HF's (~1.7x on 2 cores; docs/engines.md, "Correction")."""
    floor: bool = False
    """Also time our prefill run's projections alone each round (module docstring)."""

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be a non-empty list of sizes >= 1, got {self.batches}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (decode = N - 1), got {self.new_tokens}")
        small = {
            k: getattr(self, k)
            for k in ("prompt_len", "repeats", "tp", "agree_tokens", "group_size")
            if getattr(self, k) < 1
        }
        if small:
            raise ValueError(f"these values must be >= 1: {small}")
        from megatron_earl.rollout.embedded.engine import EmbeddedEngineConfig

        EmbeddedEngineConfig(decode_threads=self.decode_threads)  # the engine's own check, up front
        compiled = [f for f in COMPILE_SWITCHES if getattr(self, f)]
        if compiled and self.tp > 1:
            raise ValueError(
                f"{' and '.join(compiled)} must be off with tp > 1 (the compiled steps hold no "
                f"TP collectives), got tp={self.tp}"
            )


@dataclass(frozen=True)
class Agreement:
    """How closely the HF model reproduces ours (checked once, before timing)."""

    logits_max_diff: float
    """Max |logit difference| of the two models on one prompt (unpadded vocabulary)."""
    logits_tol: float
    """Allowed ``logits_max_diff``; the run stops above it."""
    logits_max_abs: float
    """Max |logit| on that prompt (the scale of the difference)."""
    first_logprob_max_diff: float
    """Max |difference| of log p(first greedy token), our engine's vs HF's, over the batch."""
    greedy_tokens_agree: int
    """Greedy tokens equal in both engines, per request up to its first difference."""
    greedy_tokens_compared: int
    """Tokens compared: requests x ``agree_tokens``."""


@dataclass(frozen=True)
class BenchRow:
    """Median figures of one engine at one batch size and sampling mode."""

    batch: int
    """Concurrent requests."""
    sampling: str
    """One of ``SAMPLING_MODES``."""
    engine: str
    """One of ``ENGINES``."""
    prefill_s: float
    """Median wall time of a prefill run (1 new token per request)."""
    full_s: float
    """Median wall time of a full run (``new_tokens`` per request)."""
    prefill_tok_s: float
    """batch x prompt_len / prefill_s."""
    decode_tok_s: float
    """batch x (new_tokens - 1) / (full_s - prefill_s)."""


@dataclass(frozen=True)
class PairedRatio:
    """Ours/HF speed ratios of one batch size and sampling mode, round by round (module
    docstring): HF's time over ours on the same prompts, back to back."""

    batch: int
    sampling: str
    prefill: tuple[float, ...]
    """Per round: HF's prefill run time / ours."""
    decode: tuple[float | None, ...]
    """Per round: HF's (full - prefill) run time / ours; None where either engine's full run
    was not longer than its prefill run (an outlier run: no decode time to compare)."""
    floor_s: tuple[float, ...] = ()
    """Per round (``--floor``; else empty): seconds of our prefill run's projections alone."""
    ceiling: tuple[float, ...] = ()
    """Per round (``--floor``): HF's prefill run time / ``floor_s`` -- the prefill ratio with
    nothing but those products on our side."""

    @property
    def prefill_median(self) -> float:
        """The median over the rounds."""
        return present_median(self.prefill)

    @property
    def decode_median(self) -> float | None:
        """The median over the rounds with a decode ratio (None: no round has one)."""
        return present_median(self.decode)


def present_median(values: tuple[float | None, ...]) -> float | None:
    """The median of the per-repeat ratios that exist (None: none does)."""
    valid = [v for v in values if v is not None]
    return statistics.median(valid) if valid else None


@dataclass(frozen=True)
class EngineBenchResult:
    """Settings, agreement, one row per (batch, sampling, engine) and the paired ratios."""

    settings: dict[str, Any]
    """Model, shapes, processes and threads of both engines, library versions."""
    agreement: Agreement
    rows: tuple[BenchRow, ...]
    ratios: tuple[PairedRatio, ...]
    """One per (batch, sampling)."""

    def ratio(self, batch: int, sampling: str) -> PairedRatio:
        """The paired ratios of one batch size and sampling mode."""
        return next(r for r in self.ratios if (r.batch, r.sampling) == (batch, sampling))

    def row(self, batch: int, sampling: str, engine: str) -> BenchRow:
        return next(
            r for r in self.rows if (r.batch, r.sampling, r.engine) == (batch, sampling, engine)
        )
