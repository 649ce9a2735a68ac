"""``bench engine --floor``'s products (``bench/engine_floor.py``) are the ones the embedded
engine's prefill forward runs: recorded at the dispatcher during a prefill step of fresh sequences
of different lengths, the 2-D matrix products (rows, in, out) are exactly those
``prefill_projections`` lists, in the same order -- for the qkv-bias model and the tied-embedding,
q/k-layernorm one. If the forward changes its products, this fails until the floor follows. The
split of a prefill run into steps (``prefill_steps``) is the real engine's: a run of prefill-only
requests over a small ``max_prefill_tokens`` takes as many prefill forwards as it lists. Bad
input: a returned count outside [1, tokens] is refused with the values named.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_embedded_engine import MAX_SEQ, MODEL, QWEN3_LIKE, _build, _prompts


class _Products(TorchDispatchMode):
    """Records (rows, in, out) of every 2-D matrix product dispatched inside it (under inference
    mode ``F.linear`` arrives whole, as ``aten.linear``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.linear.default and args[0].dim() == 2:
            x, weight = args[:2]
            self.shapes.append((x.size(0), weight.size(1), weight.size(0)))
        elif func is torch.ops.aten.mm.default:
            a, b = args
            self.shapes.append((a.size(0), a.size(1), b.size(1)))
        elif func is torch.ops.aten.addmm.default:
            a, b = args[1], args[2]
            self.shapes.append((a.size(0), a.size(1), b.size(1)))
        return func(*args, **(kwargs or {}))


def _forward_vs_floor(model):
    """(products of one eager prefill step, ``prefill_projections`` of the same step)."""
    from megatron_earl.bench.engine_floor import prefill_projections, time_projections
    from megatron_earl.rollout.embedded.batched_forward import BatchedForward
    from megatron_earl.rollout.embedded.step import Batch

    chunks, _ = _build(ParallelLayout(), None, model)
    forward = BatchedForward(chunks[0], 6, MAX_SEQ)
    prompts = _prompts()
    batch = Batch(tuple(range(len(prompts))), tuple(prompts), (0,) * len(prompts))
    with _Products() as products:
        forward(batch)
    tokens = sum(len(p) for p in prompts)
    calls = prefill_projections(chunks[0], tokens, len(prompts))
    listed = [(c.rows, c.weight.size(1), c.weight.size(0)) for c in calls]
    assert time_projections(calls) > 0
    return products.shapes, listed


@pytest.mark.parametrize("model", [MODEL, QWEN3_LIKE], ids=["qkv_bias", "qk_layernorm_tied"])
def test_floor_lists_the_prefill_forwards_products(model):
    recorded, listed = run_distributed(_forward_vs_floor, 1, args=(model,), timeout_s=300)[0]
    assert recorded == listed
    assert len(listed) == 4 * model.num_layers + 1


def _engine_prefill_steps(budget: int, sequences: int, prompt_len: int):
    """(prefill forwards the engine ran, ``prefill_steps``) for one run of ``sequences`` fresh
    prompts of ``prompt_len`` tokens, 1 new token each."""
    import asyncio

    from megatron_earl.bench.engine_floor import prefill_steps
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    chunks, _ = _build(ParallelLayout(), None, MODEL)
    config = EmbeddedEngineConfig(
        max_batch_size=sequences,
        max_seq_len=MAX_SEQ,
        max_prefills_per_step=sequences,
        max_prefill_tokens=budget,
    )
    engine = EmbeddedEngine(chunks, MODEL, config)
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    prompts = [tuple(range(i, i + prompt_len)) for i in range(sequences)]

    async def drive(eng):
        await asyncio.gather(*(eng.generate(GenerateRequest(p, one)) for p in prompts))
        return eng.pace_stats.prefill_steps

    ran = run_engine(engine, drive)
    return ran, len(prefill_steps(sequences, prompt_len, budget))


@pytest.mark.parametrize(("budget", "sequences", "prompt_len"), [(64, 7, 20), (30, 3, 20)])
def test_prefill_steps_are_the_engines(budget, sequences, prompt_len):
    ran, listed = run_distributed(
        _engine_prefill_steps, 1, args=(budget, sequences, prompt_len), timeout_s=300
    )[0]
    assert ran == listed > 1


def _refused():
    from megatron_earl.bench.engine_floor import prefill_projections

    chunks, _ = _build(ParallelLayout(), None, MODEL)
    errors = []
    for returned in (0, 11):
        try:
            prefill_projections(chunks[0], 10, returned)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_a_returned_count_outside_the_tokens_is_refused():
    errors = run_distributed(_refused, 1, timeout_s=120)[0]
    assert len(errors) == 2
    assert "returned must be in [1, tokens=10]" in errors[0] and errors[0].endswith("got 0")
    assert errors[1].endswith("got 11")
