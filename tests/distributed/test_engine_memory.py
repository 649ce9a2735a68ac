"""The embedded engine's colocation memory at TP2: a release runs on every rank of the TP group
(each rank's KV cache and weight shards go to 0 bytes, the shards wait on the host), and after
the resume the engine gives the same greedy tokens and log-probs as before the release."""

from __future__ import annotations

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=250,
    make_vocab_size_divisible_by=64,
)
PROMPTS = ((5, 17, 9, 23, 3), (12, 7, 1))


def _release_resume() -> dict:
    from megatron_earl import runtime
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.config.vocab import MEMORY_TAGS
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    initialize_layout(ParallelLayout(tp=2))
    runtime.seed(1234)
    engine = EmbeddedEngine(
        build_model(MODEL), MODEL, EmbeddedEngineConfig(max_batch_size=2, max_seq_len=32)
    )
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    requests = [GenerateRequest(p, greedy) for p in PROMPTS]
    out: dict = {"before_bytes": engine.memory_bytes()}

    async def generate_then_release(eng):
        import asyncio

        results = await asyncio.gather(*(eng.generate(r) for r in requests))
        await eng.release_memory_occupation(MEMORY_TAGS)
        return results

    async def resume_then_generate(eng):
        import asyncio

        await eng.resume_memory_occupation(MEMORY_TAGS)
        return await asyncio.gather(*(eng.generate(r) for r in requests))

    before = run_engine(engine, generate_then_release)
    out["released_bytes"] = engine.memory_bytes()  # every rank: its own shards and cache
    after = run_engine(engine, resume_then_generate)
    out["resumed_bytes"] = engine.memory_bytes()
    if before is not None:
        out["before"] = [(r.output_ids, r.output_logprobs) for r in before]
        out["after"] = [(r.output_ids, r.output_logprobs) for r in after]
    return out


def test_release_and_resume_on_every_tp_rank_keep_the_outputs():
    outs = run_distributed(_release_resume, 2, timeout_s=180)
    for rank, out in enumerate(outs):
        before, released = out["before_bytes"], out["released_bytes"]
        assert before["kv_cache_bytes"] > 0 and before["weight_bytes"] > 0, rank
        assert released["kv_cache_bytes"] == released["weight_bytes"] == 0, rank
        assert released["weight_backup_bytes"] == before["weight_bytes"], rank
        assert out["resumed_bytes"] == before, rank
    assert outs[0]["after"] == outs[0]["before"]
