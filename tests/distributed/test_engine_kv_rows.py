"""The embedded engine sizes its KV cache from a memory budget (``kv_cache_bytes``): it allocates
the whole rows of ``max_seq_len`` tokens the budget holds, at most ``max_batch_size``; requests
beyond them wait for a row and complete (queueing, not OOM), with the same greedy tokens as an
engine with a row per request; a budget that holds no row is refused with the figures.

The model: 2 layers, 2 KV groups of head dim 16, fp32; a row of 40 tokens is 2 x 2 (K/V) x 2 x
40 x 16 x 4 B = 20 KiB, so a budget of 2.5 rows gives 2 rows. One process."""

from __future__ import annotations

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.testing.distributed import run_distributed

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=250,
    make_vocab_size_divisible_by=64,
    init_method_std=0.1,
)
MAX_SEQ = 40
ROW_BYTES = 2 * 2 * 2 * MAX_SEQ * 16 * 4
PROMPTS = [tuple(range(3 + i, 10 + 2 * i)) for i in range(6)]


def _generate(budget_bytes: float | None, max_rows: int) -> dict:
    import asyncio

    from megatron_earl import runtime
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    initialize_layout(ParallelLayout())
    runtime.seed(1234)
    chunks = build_model(MODEL)
    settings = EmbeddedEngineConfig(
        max_batch_size=max_rows, max_seq_len=MAX_SEQ, kv_cache_bytes=budget_bytes
    )
    engine = EmbeddedEngine(chunks, MODEL, settings)
    running: list[int] = []

    async def driver(eng):
        async def watch():  # the most requests holding a row at once
            while True:
                running.append(eng.num_running)
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        results = await asyncio.gather(*(eng.generate(GenerateRequest(p, params)) for p in PROMPTS))
        watcher.cancel()
        return [list(r.output_ids) for r in results]

    outputs = run_engine(engine, driver)
    return {
        "rows": engine.num_rows,
        "kv_bytes": engine.memory_bytes()["kv_cache_bytes"],
        "outputs": outputs,
        "max_running": max(running),
    }


def _refused() -> str:
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    initialize_layout(ParallelLayout())
    runtime.seed(1234)
    chunks = build_model(MODEL)
    settings = EmbeddedEngineConfig(max_seq_len=MAX_SEQ, kv_cache_bytes=ROW_BYTES - 1)
    try:
        EmbeddedEngine(chunks, MODEL, settings)
    except ValueError as err:
        return str(err)
    return "built"


def test_rows_come_from_the_budget_and_the_rest_wait():
    budget = run_distributed(_generate, 1, args=(2.5 * ROW_BYTES, 8), timeout_s=300)[0]
    unbounded = run_distributed(_generate, 1, args=(None, 8), timeout_s=300)[0]
    assert (budget["rows"], budget["kv_bytes"]) == (2, 2 * ROW_BYTES)
    assert budget["max_running"] == 2  # 6 requests, 2 rows: 4 waited
    assert (unbounded["rows"], unbounded["kv_bytes"]) == (8, 8 * ROW_BYTES)
    assert budget["outputs"] == unbounded["outputs"]  # queued, same tokens
    assert all(len(o) == 12 for o in budget["outputs"])


@pytest.mark.parametrize("cap", [3])
def test_the_cap_bounds_a_large_budget(cap):
    out = run_distributed(_generate, 1, args=(100 * ROW_BYTES, cap), timeout_s=300)[0]
    assert out["rows"] == cap and out["max_running"] <= cap


def test_a_budget_that_holds_no_row_is_refused():
    message = run_distributed(_refused, 1, timeout_s=300)[0]
    assert "holds no row of max_seq_len=40 tokens" in message
    assert "(0.01953 MiB a row" in message and "give it at least 0.01953 MiB" in message
