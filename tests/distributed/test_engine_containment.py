"""A request that fails inside the embedded engine's loop fails alone (issue 22, item 2).

* A forward that raises (fault injected into the prefill of one request, as an out-of-memory on a
  long prompt would) fails only the requests of that step: a request already decoding finishes
  with exactly the tokens it gets without the fault, later requests are served, the engine stays
  healthy. Three failing forwards in a row fail the engine (a persistent fault is not hidden).
* Non-finite weights (a diverged update loaded by an external reshard) fail each request with a
  message naming non-finite logits (prompt log-probs too); the engine stays healthy and serves
  again once finite weights are loaded.
* A caller that cancels its ``generate`` (a client gone) cancels only that request, running or
  queued: its row is freed, the others finish, the engine serves the next one; a request sent
  without an id gets the engine's, which its result carries and ``abort`` finds.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.testing.distributed import run_distributed

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    make_vocab_size_divisible_by=64,
)
POISON = 77
"""A prompt starting with this token makes the injected forward raise."""


def _engine(faulty_prefill: bool = True):
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    initialize_layout(ParallelLayout())
    runtime.seed(5)
    chunks = build_model(MODEL)
    engine = EmbeddedEngine(chunks, MODEL, EmbeddedEngineConfig(max_batch_size=4, max_seq_len=64))
    if not faulty_prefill:
        return engine
    real = engine._forward

    def faulty(batch):
        if not batch.is_decode and any(t[0] == POISON for t in batch.tokens):
            raise RuntimeError("injected: out of memory in the prefill")
        return real(batch)

    engine._forward = faulty
    return engine


def _forward_failure_run():
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import run_engine
    from megatron_earl.rollout.engine import EngineError, GenerateRequest

    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    engine = _engine()

    async def driver(eng):
        alone = await eng.generate(GenerateRequest((1, 2, 3), greedy))
        running = asyncio.create_task(eng.generate(GenerateRequest((1, 2, 3), greedy)))
        while eng.num_running == 0:
            await asyncio.sleep(0.001)
        with pytest.raises(EngineError, match="injected: out of memory"):
            await eng.generate(GenerateRequest((POISON, 5), greedy))
        survivor = await running
        after = await eng.generate(GenerateRequest((4, 5), greedy))
        healthy = await eng.health()
        for _ in range(3):  # a persistent fault fails the engine
            with pytest.raises(EngineError):
                await eng.generate(GenerateRequest((POISON, 6), greedy))
        return alone, survivor, after, healthy, await eng.health()

    return run_engine(engine, driver)


def _nan_weights_run():
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.redistribute.geometry import full_state_dict
    from megatron_earl.rollout.embedded.engine import run_engine
    from megatron_earl.rollout.engine import EngineError, GenerateRequest

    engine = _engine()
    good = {k: v.clone() for k, v in full_state_dict(engine.model_chunks).items()}
    bad = {k: torch.full_like(v, float("nan")) for k, v in good.items()}
    request = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=4, temperature=1.0))

    async def driver(eng):
        before = await eng.generate(request)
        await eng.load_state_dict(bad, 1)
        with pytest.raises(EngineError, match="non-finite logits"):
            await eng.generate(request)
        scoring = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=0), logprob_start_len=0)
        with pytest.raises(EngineError, match="prompt log-probs failed: non-finite logits"):
            await eng.generate(scoring)
        healthy = await eng.health()
        await eng.load_state_dict(good, 2)
        return before, healthy, await eng.generate(request)

    return run_engine(engine, driver)


def test_failed_forward_fails_only_its_requests():
    alone, survivor, after, healthy, finally_healthy = run_distributed(
        _forward_failure_run, 1, timeout_s=120
    )[0]
    assert survivor.output_ids == alone.output_ids and len(alone.output_ids) == 24
    assert len(after.output_ids) == 24 and healthy
    assert not finally_healthy


def test_non_finite_weights_fail_requests_not_the_engine():
    before, healthy, after = run_distributed(_nan_weights_run, 1, timeout_s=120)[0]
    assert healthy
    assert len(before.output_ids) == len(after.output_ids) == 4 and after.weight_version == 2


def _progress_failure_run():
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import run_engine
    from megatron_earl.rollout.engine import EngineError, GenerateRequest

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    engine = _engine(faulty_prefill=False)
    seen = []

    def broken(rid, token, logprob):
        raise RuntimeError("injected: stream writer gone")

    async def driver(eng):
        other = asyncio.create_task(eng.generate(GenerateRequest((1, 2, 3), greedy)))
        with pytest.raises(EngineError, match=r"progress failed.*stream writer gone"):
            await eng.generate(GenerateRequest((1, 2, 3), greedy), broken)
        streamed = await eng.generate(GenerateRequest((1, 2, 3), greedy), lambda *a: seen.append(a))
        return await other, streamed, list(seen), await eng.health()

    return run_engine(engine, driver)


def test_a_failing_progress_callback_fails_only_its_request():
    other, streamed, seen, healthy = run_distributed(_progress_failure_run, 1, timeout_s=120)[0]
    assert healthy and other.output_ids == streamed.output_ids and len(other.output_ids) == 6
    # one call per token but the last, with the request's id, the token and its log-prob
    assert [(t, lp) for _, t, lp in seen] == list(zip(other.output_ids, other.output_logprobs))[:5]


def _top_failure_run():
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded import results as engine_results
    from megatron_earl.rollout.embedded.engine import run_engine
    from megatron_earl.rollout.engine import EngineError, GenerateRequest

    def broken(*args):
        raise RuntimeError("injected: top-k failed")

    engine_results._top_logprobs = broken
    engine = _engine(faulty_prefill=False)

    async def driver(eng):
        plain = asyncio.create_task(
            eng.generate(GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=4)))
        )
        # finishes (length 1) in the very step whose top log-probs fail: retired once, failed
        last = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=1), top_logprobs_num=2)
        with pytest.raises(EngineError, match=r"top log-probs failed.*injected"):
            await eng.generate(last)
        return await plain, eng.num_running, await eng.health()

    return run_engine(engine, driver)


def test_failing_top_logprobs_fail_only_their_request():
    plain, running, healthy = run_distributed(_top_failure_run, 1, timeout_s=120)[0]
    assert len(plain.output_ids) == 4 and running == 0 and healthy


def _cancel_run():
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import run_engine
    from megatron_earl.rollout.engine import GenerateRequest

    long = SamplingParams(max_new_tokens=60, temperature=0.0)
    engine = _engine(faulty_prefill=False)  # 4 rows

    async def until_running(eng, rows):
        while eng.num_running < rows:
            await asyncio.sleep(0.001)

    async def driver(eng):
        calls = [eng.generate(GenerateRequest((1 + i, 2, 3), long)) for i in range(5)]
        tasks = [asyncio.create_task(call) for call in calls]
        await until_running(eng, 4)  # four decoding, the fifth queued
        running, queued = tasks[0], tasks[4]
        waiting = eng.num_requests - eng.num_running
        running.cancel()
        queued.cancel()
        cancelled = await asyncio.gather(running, queued, return_exceptions=True)
        others = await asyncio.gather(*tasks[1:4])
        after = await eng.generate(GenerateRequest((9, 9), long))
        rids = []
        named = asyncio.create_task(
            eng.generate(GenerateRequest((4, 5), long), lambda rid, *_: rids.append(rid))
        )
        while not rids:
            await asyncio.sleep(0.001)
        await eng.abort(rids[0])
        aborted = await named
        left = (eng.num_requests, await eng.health())
        return waiting, [type(c).__name__ for c in cancelled], others, after, rids[0], aborted, left

    return run_engine(engine, driver)


def test_a_cancelled_call_cancels_only_its_request():
    from megatron_earl.rollout.engine import FinishType

    waiting, cancelled, others, after, rid, aborted, left = run_distributed(
        _cancel_run, 1, timeout_s=120
    )[0]
    assert waiting == 1 and cancelled == ["CancelledError", "CancelledError"]
    assert [len(r.output_ids) for r in others] == [60, 60, 60] and len(after.output_ids) == 60
    assert rid.startswith("emb-") and aborted.rid == rid
    assert aborted.finish_reason.type == FinishType.ABORT and 0 < len(aborted.output_ids) < 60
    assert left == (0, True)
