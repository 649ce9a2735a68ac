"""A paced embedded engine (``EmbeddedEngineConfig.pace_decode_s``, ``serve --pace-decode-ms``):
every decode step lasts at least the pace (forward + the sleep after it) and the tokens are
those of the unpaced engine (greedy and seeded sampling, more requests than rows); the unpaced
engine's steps are faster than the pace here (the tiny model), so the test can fail."""

from __future__ import annotations

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.rollout.embedded.engine import EmbeddedEngineConfig
from megatron_earl.testing.distributed import run_distributed

MODEL = ModelConfig(
    num_layers=1,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    make_vocab_size_divisible_by=64,
)
PACE_S = 0.03


def _generate(pace_s: float) -> dict:
    import asyncio
    import time

    from megatron_earl import runtime
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine, run_engine
    from megatron_earl.rollout.engine import GenerateRequest

    initialize_layout(ParallelLayout())
    runtime.seed(11)
    chunks = build_model(MODEL)
    config = EmbeddedEngineConfig(max_batch_size=2, max_seq_len=40, pace_decode_s=pace_s)
    engine = EmbeddedEngine(chunks, MODEL, config)
    requests = [
        GenerateRequest(
            (3 + i, 7, 9 + i),
            SamplingParams(max_new_tokens=6 + 2 * i, temperature=temp, seed=100 + i),
        )
        for i, temp in enumerate((0.0, 1.0, 0.0, 1.0))
    ]

    async def driver(engine):
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return [list(r.output_ids) for r in results], time.perf_counter() - start

    tokens, wall_s = run_engine(engine, driver)
    return {"tokens": tokens, "wall_s": wall_s, "stats": engine.pace_stats.to_dict()}


def test_paced_steps_last_the_pace_and_tokens_are_unchanged():
    unpaced = run_distributed(_generate, 1, args=(0.0,), timeout_s=120)[0]
    paced = run_distributed(_generate, 1, args=(PACE_S,), timeout_s=120)[0]
    assert paced["tokens"] == unpaced["tokens"]
    assert [len(t) for t in paced["tokens"]] == [6, 8, 10, 12]
    stats, base = paced["stats"], unpaced["stats"]
    assert stats["paced"] and not base["paced"]
    assert stats["pace_decode_ms"] == pytest.approx(PACE_S * 1e3)  # the setting in ms (fp64)
    assert stats["decode_steps"] == base["decode_steps"] > 0
    assert stats["min_step_ms"] >= PACE_S * 1e3
    assert base["min_step_ms"] < PACE_S * 1e3  # unpaced steps are faster: pacing is visible
    assert paced["wall_s"] >= stats["decode_steps"] * PACE_S
    assert stats["overruns"] == 0 or stats["max_forward_ms"] > PACE_S * 1e3
    assert stats["prefill_steps"] >= 2 and stats["mean_prefill_ms"] > 0  # 4 requests, 2 rows


def test_pace_must_be_non_negative():
    with pytest.raises(ValueError, match=r"pace_decode_s must be .* got -1"):
        EmbeddedEngineConfig(pace_decode_s=-1)
