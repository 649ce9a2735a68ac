"""The measuring loop of ``bench engine`` (``megatron_earl/bench/engine.py`` says what is
measured and why): runs on the scheduler rank inside ``run_engine``, alternating our embedded
engine and the HF model on the same prompts.

Our engine is used only through its public API (``EmbeddedEngine.generate`` with
``GenerateRequest`` / ``SamplingParams``). While HF runs, the driver blocks the event loop: no
request of ours is in flight then, and the engine's other TP ranks wait for the next step.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from megatron_earl.bench import engine_hf as bench_hf
from megatron_earl.bench.engine_results import (
    ENGINES,
    SAMPLING_MODES,
    BenchRow,
    EngineBenchConfig,
    PairedRatio,
)
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import GenerateRequest, GenerateResult


@contextmanager
def _threads(num: int) -> Iterator[None]:
    """``torch`` intra-op threads set to ``num`` inside the block (HF gets every core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Pair:
    """Both engines behind one call shape: (prompts [B, T], new tokens, sampled) -> (seconds,
    new tokens per request)."""

    def __init__(self, engine: Any, hf: Any) -> None:
        self.engine, self.hf = engine, hf

    async def ours(
        self, prompts: torch.Tensor, new_tokens: int, sampled: bool
    ) -> tuple[float, list[GenerateResult]]:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0 if sampled else 0.0)
        requests = [GenerateRequest(tuple(row.tolist()), params) for row in prompts]
        start = time.perf_counter()
        results = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        seconds = time.perf_counter() - start
        odd = [(len(r.output_ids), r.cached_tokens) for r in results]
        if any(o != (new_tokens, 0) for o in odd):
            raise RuntimeError(
                f"every request must generate {new_tokens} tokens without prefix-cache hits; "
                f"got (tokens, cached) {sorted(set(odd))}"
            )
        return seconds, list(results)

    def theirs(
        self, prompts: torch.Tensor, new_tokens: int, sampled: bool
    ) -> tuple[float, torch.Tensor]:
        with _threads(os.cpu_count() or 1):
            return bench_hf.hf_generate(self.hf, prompts, new_tokens, sampled=sampled)


async def _agreement(pair: _Pair, prompts: torch.Tensor, num_tokens: int) -> tuple[float, int, int]:
    """Greedy on both engines: (max |log p(first token)| difference, tokens agreeing, compared)."""
    _, mine = await pair.ours(prompts, num_tokens, False)
    _, theirs = pair.theirs(prompts, num_tokens, False)
    agree = bench_hf.greedy_agreement([r.output_ids for r in mine], theirs, num_tokens)
    first = torch.tensor([r.output_ids[0] for r in mine])
    with _threads(os.cpu_count() or 1):
        hf_logprobs = bench_hf.hf_next_logprobs(pair.hf, prompts, first)
    ours_logprobs = torch.tensor([r.output_logprobs[0] for r in mine], dtype=torch.float32)
    diff = float((hf_logprobs - ours_logprobs).abs().max())
    return diff, agree, prompts.size(0) * num_tokens


def _sequences(batch: int, group_size: int) -> int:
    """Distinct prompts of a batch of ``group_size``-request groups: the sequences our engine
    prefills (a group's requests share one prefill)."""
    return -(-batch // group_size)


def _rows(
    cfg: EngineBenchConfig, batch: int, sampling: str, times: dict[str, list[list[float]]]
) -> list[BenchRow]:
    rows = []
    for engine, (prefills, fulls) in times.items():
        prefill, full = statistics.median(prefills), statistics.median(fulls)
        rows.append(
            BenchRow(
                batch=batch,
                sampling=sampling,
                engine=engine,
                prefill_s=prefill,
                full_s=full,
                prefill_tok_s=batch * cfg.prompt_len / prefill,
                decode_tok_s=batch * (cfg.new_tokens - 1) / max(full - prefill, 1e-9),
            )
        )
    return rows


def _paired(
    batch: int, sampling: str, times: dict[str, list[list[float]]], floor_s: Sequence[float] = ()
) -> PairedRatio:
    """HF's time over ours, repeat by repeat (prefill runs; full minus prefill runs, None where
    either engine's prefill run took as long as its full run); with ``floor_s`` (our prefill's
    projections alone, per repeat), HF's prefill run time over it."""
    (ours_pre, ours_full), (hf_pre, hf_full) = (times[e] for e in ENGINES)
    prefill = tuple(h / o for h, o in zip(hf_pre, ours_pre, strict=True))
    decode = tuple(
        (hf_f - hf_p) / (o_f - o_p) if o_f > o_p and hf_f > hf_p else None
        for hf_f, hf_p, o_f, o_p in zip(hf_full, hf_pre, ours_full, ours_pre, strict=True)
    )
    ceiling = tuple(h / f for h, f in zip(hf_pre, floor_s, strict=True)) if floor_s else ()
    return PairedRatio(batch, sampling, prefill, decode, tuple(floor_s), ceiling)


async def drive(
    engine: Any, hf: Any, cfg: EngineBenchConfig
) -> tuple[list[BenchRow], list[PairedRatio], tuple, float]:
    """Warm up, compare greedy outputs once, then time every (batch, sampling mode): per repeat
    a prefill run and a full run of each engine, ours then HF, on fresh shared prompts (with
    ``cfg.floor``: our prefill's projections alone after HF's prefill run, on the threads our
    prefill steps use). Returns the rows, the paired ratios, the greedy agreement and the
    seconds of our first (warm-up) run."""
    from megatron_earl.bench.engine_floor import prefill_run_projections, time_projections

    prefill_threads = torch.get_num_threads()  # as the engine read them when it was built

    pair = _Pair(engine, hf)
    gen = torch.Generator().manual_seed(cfg.seed + 2)

    def prompts(batch: int) -> torch.Tensor:
        """Fresh random prompts, each repeated for ``group_size`` consecutive requests."""
        distinct = _sequences(batch, cfg.group_size)
        fresh = torch.randint(0, cfg.model.vocab_size, (distinct, cfg.prompt_len), generator=gen)
        return fresh.repeat_interleave(cfg.group_size, dim=0)[:batch]

    warm = prompts(2)
    start = time.perf_counter()
    await pair.ours(warm, 2, False)  # the engine's first step compiles every compiled graph
    warmup_s = time.perf_counter() - start
    pair.theirs(warm, 2, False)
    greedy = await _agreement(pair, prompts(cfg.batches[0]), min(cfg.agree_tokens, cfg.new_tokens))
    rows: list[BenchRow] = []
    ratios: list[PairedRatio] = []
    for batch in cfg.batches:
        warm = prompts(batch)  # first use of this batch shape: untimed
        await pair.ours(warm, 2, False)
        pair.theirs(warm, 2, False)
        projections = (
            prefill_run_projections(
                engine.model_chunks[0],
                _sequences(batch, cfg.group_size),
                cfg.prompt_len,
                engine.config.max_prefill_tokens,
            )
            if cfg.floor
            else []
        )
        for sampling in SAMPLING_MODES:
            sampled = sampling == "sampled"
            times: dict[str, list[list[float]]] = {e: [[], []] for e in ENGINES}
            floor_s: list[float] = []
            for _ in range(cfg.repeats):
                for slot, new_tokens in enumerate((1, cfg.new_tokens)):
                    shared = prompts(batch)
                    ours_s, _ = await pair.ours(shared, new_tokens, sampled)
                    hf_s, _ = pair.theirs(shared, new_tokens, sampled)
                    times[ENGINES[0]][slot].append(ours_s)
                    times[ENGINES[1]][slot].append(hf_s)
                    if cfg.floor and slot == 0:
                        with _threads(prefill_threads):
                            floor_s.append(time_projections(projections))
            rows += _rows(cfg, batch, sampling, times)
            ratios.append(_paired(batch, sampling, times, floor_s))
    return rows, ratios, greedy, warmup_s
