"""A TP2 embedded engine left idle longer than its TP group's timeout keeps working: the idle
scheduler pings its peer (``PING_INTERVAL_S``) so the peer's wait for the next step never times
out (a ``megatron-earl serve --tp-size 2`` idle for over Megatron's 30 minutes). Here the group's
timeout is cut to 2 s and the engine idles 5 s; without the ping the peer's receive fails. Also
``call`` runs on every rank and names a failing one, and ``state_dict`` gathers the TP shards
back to the full tensors."""

from __future__ import annotations

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

MODEL = ModelConfig(
    num_layers=1,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    make_vocab_size_divisible_by=64,
)


def _rank(engine) -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _fail_on_rank1(engine) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")


def _idle_run(ping_s: float) -> dict | None:
    import asyncio
    import datetime

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_earl import runtime
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import full_state_dict, load_full_state_dict
    from megatron_earl.rollout.embedded import engine as embedded
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    embedded.PING_INTERVAL_S = ping_s
    initialize_layout(ParallelLayout(dp=2))
    runtime.seed(5)
    full = full_state_dict(build_model(MODEL), replicas=True)
    initialize_layout(ParallelLayout(tp=2))
    chunks = build_model(MODEL)
    load_full_state_dict(chunks, full)
    group = parallel_state.get_tensor_model_parallel_group()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2), group)
    engine = EmbeddedEngine(chunks, MODEL, EmbeddedEngineConfig(max_batch_size=2, max_seq_len=32))

    async def driver(eng):
        await asyncio.sleep(5)  # idle: longer than the group's timeout
        result = await eng.generate(
            GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=4, temperature=0.0))
        )
        ranks = await eng.call(_rank)
        try:
            await eng.call(_fail_on_rank1)
            failure = None
        except RuntimeError as err:
            failure = str(err)
        gathered = await eng.state_dict()
        same = sorted(gathered) == sorted(full) and all(
            torch.equal(gathered[k], full[k]) for k in full
        )
        return {"tokens": result.output_ids, "ranks": ranks, "failure": failure, "same": same}

    return run_engine(engine, driver)


def test_idle_tp2_engine_outlives_its_group_timeout():
    out = run_distributed(_idle_run, 2, args=(0.5,), timeout_s=120)[0]  # ping 100 s: rank 1 fails
    assert len(out["tokens"]) == 4
    assert out["ranks"] == [0, 1]
    assert out["failure"] == "TP rank 1: ValueError: rank 1 refuses"
    assert out["same"]
