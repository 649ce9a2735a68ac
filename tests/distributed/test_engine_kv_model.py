"""The memory model's estimate of what the embedded engine allocates when it is built (its whole
row KV cache and its RoPE tables: ``ReservedKV``), against the bytes the engine's construction
actually creates, counted by the project's CPU accounting (every storage an ATen op creates,
``selector.budget``), on the demo model (4 layers, 2 KV groups of head dim 32, fp32) with the
engine settings the RL loop derives from the config (``engine_config`` / ``engine_kv``).

The arithmetic: KV = rows x context x layers x 2 (k, v) x groups x head dim x 4 B = 4 x 4096 x
2048 B = 32 MiB; RoPE = context x head dim x (4 B of Megatron's cached fp32 table + cos and sin
in fp32) = 1.5 MiB; nothing else the engine holds is sized from the context. So the bytes alive
after construction match the estimate to 0.1 % (the rest is the engine's small bookkeeping), and
the construction's peak (the RoPE computation's transients on top) to 5 %. One process."""

from __future__ import annotations

CONTEXT, ROWS = 4096, 4
OVERRIDES = [f"rollout.max_context={CONTEXT}", f"rollout.max_concurrency={ROWS}"]


def _engine_allocation() -> dict:
    from megatron_earl import runtime
    from megatron_earl.config.loader import load_config
    from megatron_earl.config.vocab import Phase
    from megatron_earl.models.gpt import build_model
    from megatron_earl.orchestration.engines.embedded import engine_config
    from megatron_earl.orchestration.selection import engine_kv
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine
    from megatron_earl.selector.budget import MemoryBudget
    from megatron_earl.selector.memory import MemoryModel, MemorySettings, PhaseWorkload

    config = load_config("configs/demo_cpu.yaml", OVERRIDES)
    layout = ParallelLayout()
    initialize_layout(layout)
    runtime.seed(1234)
    chunks = build_model(config.model)
    budget = MemoryBudget(1 << 40)
    with budget.track() as measured:
        engine = EmbeddedEngine(chunks, config.model, engine_config(config, layout))
        alive = budget._mode.live  # bytes created by the construction and still alive
    work = PhaseWorkload.for_lengths(Phase.ROLLOUT, [1], reserved_kv=engine_kv(config))
    memory = MemoryModel(config.model, MemorySettings.cpu())
    return {
        "alive": alive,
        "peak": measured.dynamic_peak_bytes,
        "kv_cache_bytes": engine.memory_bytes()["kv_cache_bytes"],
        "estimate_kv": memory.kv_cache(layout, work),
        "estimate": memory.kv_cache(layout, work) + memory.rotary_tables(Phase.ROLLOUT, work),
    }


def test_reserved_kv_estimate_matches_what_the_engine_allocates():
    from megatron_earl.testing.distributed import run_distributed

    out = run_distributed(_engine_allocation, 1, timeout_s=300)[0]
    assert out["estimate_kv"] == out["kv_cache_bytes"] == ROWS * CONTEXT * 2048
    assert abs(out["alive"] - out["estimate"]) <= 0.001 * out["estimate"], out
    assert out["estimate"] <= out["peak"] <= 1.05 * out["estimate"], out
