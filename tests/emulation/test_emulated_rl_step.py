"""The RL step and the embedded engine on the emulated device equal their CPU references.

* Two RL train steps (policy loss with KL, entropy, dual clip, TIS) in tp2, pp2, cp2 and dp2 on
  the emulated device give the metrics of the single-process CPU run within the CPU tests'
  fp32 bounds (``tests/tolerances.py``). The parameters are checked to live on the device; a
  host tensor anywhere in the step (micro-batch, loss, DDP buffers, optimizer) would have failed
  the run, and so would a collective on a group of the wrong role.
* Greedy generation on the embedded engine (KV cache on the device) at TP1 and TP2 equals the
  CPU full-recompute decode token for token.
* Negative: the same runs with one host tensor planted on the data path (a micro-batch's tokens,
  the KV cache) fail with a message naming the op, the planted tensor's shape and the call site.
"""

from __future__ import annotations

from unittest import mock

import pytest

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import DistributedTestError, run_distributed
from tests.distributed import test_embedded_engine as engine_case
from tests.distributed import test_rl_step as step_case
from tests.distributed import test_zero_advantage as skip_case
from tests.emulation.common import EMULATED, on_emulated_device, to_host


def _emulated_train(layout: ParallelLayout, weights, steps: int, plant: bool = False):
    from megatron_earl.training import rl_step

    split = rl_step.split_micro_batch

    def planted(mb, cp, cp_rank):  # the tokens of every micro-batch left on the host
        out = split(mb, cp, cp_rank)
        return {**out, "tokens": out["tokens"].cpu()}

    with mock.patch.object(rl_step, "split_micro_batch", planted if plant else split):
        result = step_case._train(layout, weights, steps)
    result["on_device"] = on_emulated_device(t for *_, t in result["params"])
    return to_host(result)


@pytest.fixture(scope="module")
def cpu_reference():
    (res,) = run_distributed(step_case._train, 1, args=(ParallelLayout(), None, 2), timeout_s=180)
    return res


@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(tp=2), ParallelLayout(pp=2), ParallelLayout(cp=2), ParallelLayout(dp=2)],
    ids=str,
)
def test_rl_step_on_the_emulated_device_equals_cpu(cpu_reference, layout):
    results = run_distributed(
        _emulated_train,
        layout.world_size,
        args=(layout, cpu_reference["weights"], 2),
        timeout_s=240,
        env=EMULATED,
    )
    for res in results:
        assert res["on_device"]
        for got, want in zip(res["metrics"], cpu_reference["metrics"], strict=True):
            if not got:  # a pipeline stage without the loss
                continue
            for k in step_case.COMPARED:  # the CPU tests' fp32 bound, relative above 1
                tol = step_case.TOL * max(1.0, abs(want[k]))
                assert abs(got[k] - want[k]) <= tol, (layout, k, got[k], want[k])


def _emulated_sequence_parallel(layout: ParallelLayout, weights):
    from tests.distributed import test_sequence_parallel as sp_case

    result = sp_case._run(layout, weights)
    result["on_device"] = on_emulated_device(t for *_, t in result["params"])
    return to_host(result)


def test_sequence_parallel_on_the_emulated_device_equals_cpu():
    """Sequence parallelism at tp2 on the emulated device (the tail padding, the marked norms'
    TP gradient reduction, the head's all-gather and the engine's own embedding lookup all on
    the device) gives the single-process CPU run's parameters, metrics, log-probs and engine
    logits (the CPU test's fp32 bounds)."""
    from tests.distributed import test_sequence_parallel as sp_case

    (ref,) = run_distributed(sp_case._run, 1, args=(ParallelLayout(), None), timeout_s=180)
    layout = ParallelLayout(tp=2)
    results = run_distributed(
        _emulated_sequence_parallel, 2, args=(layout, ref["weights"]), timeout_s=240, env=EMULATED
    )
    for res in results:
        assert res["on_device"] and res["sp_on"]
        step_case.assert_matches_reference(res, ref, sp_case.SP_TERMS)  # weights and metrics
        for got, want in zip(res["logprobs"] + res["engine"], ref["logprobs"] + ref["engine"]):
            assert (got - want).abs().max() <= sp_case.forward_tol(want)


def test_planted_host_micro_batch_fails_naming_it(cpu_reference):
    with pytest.raises(DistributedTestError) as err:
        run_distributed(
            _emulated_train,
            1,
            args=(ParallelLayout(), cpu_reference["weights"], 1, True),
            timeout_s=120,
            env=EMULATED,
        )
    message = str(err.value)
    assert "HostDeviceMixError: aten::embedding got a host tensor of shape (1, " in message
    assert "(torch.int64)" in message
    assert "megatron/core/tensor_parallel/layers.py" in message  # the op's own line ...
    assert "megatron_earl/training/schedule.py" in message  # ... and ours that fed it


def _emulated_generate(layout: ParallelLayout, weights, plant: bool = False):
    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import (
        EmbeddedEngine,
        EmbeddedEngineConfig,
        run_engine,
    )
    from megatron_earl.rollout.engine import GenerateRequest

    chunks, _ = engine_case._build(layout, weights)
    engine = EmbeddedEngine(
        chunks, engine_case.MODEL, EmbeddedEngineConfig(max_batch_size=3, max_seq_len=40)
    )
    cache = engine._forward.cache
    on_device = on_emulated_device(cache.buffers())
    if plant:  # the KV cache of the last layer left on the host
        cache.keys[-1], cache.values[-1] = cache.keys[-1].cpu(), cache.values[-1].cpu()

    async def driver(eng):
        import asyncio

        greedy = [
            GenerateRequest(p, SamplingParams(max_new_tokens=n, temperature=0.0))
            for p, n in zip(engine_case._prompts(), engine_case.MAX_NEW)
        ]
        return await asyncio.gather(*(eng.generate(r) for r in greedy))

    results = run_engine(engine, driver)
    outputs = None if results is None else [list(r.output_ids) for r in results]
    return {"outputs": outputs, "cache_on_device": on_device}


@pytest.fixture(scope="module")
def decode_reference():
    args = (engine_case._prompts(), engine_case.MAX_NEW)
    return run_distributed(engine_case._reference, 1, args=args, timeout_s=120)[0]


@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2)], ids=str)
def test_engine_on_the_emulated_device_equals_cpu_decode(decode_reference, layout):
    weights, expected = decode_reference
    results = run_distributed(
        _emulated_generate, layout.world_size, args=(layout, weights), timeout_s=180, env=EMULATED
    )
    assert all(r["cache_on_device"] for r in results)
    assert results[0]["outputs"] == expected


def test_planted_host_kv_cache_fails_naming_it(decode_reference):
    weights, _ = decode_reference
    with pytest.raises(DistributedTestError) as err:
        run_distributed(
            _emulated_generate, 1, args=(ParallelLayout(), weights, True), timeout_s=120,
            env=EMULATED,
        )  # fmt: skip
    message = str(err.value)
    # The KV cache's shape: [max_batch_size, query groups, max_seq_len, head dim].
    assert "aten::index_put_ got a host tensor of shape (3, 2, 40, 16)" in message
    assert "megatron_earl/rollout/embedded/kv_cache.py" in message


def _emulated_skip(layout: str, aggregation: str):
    return to_host(skip_case._both(layout, aggregation))


def test_zero_advantage_skip_on_the_emulated_device():
    """The zero-advantage skip (per-sample flags read from device tensors, the batch subset on
    the device) leaves the update as the whole batch gives it, as on the CPU."""
    layout = "tp1cp1pp1dp2"
    results = run_distributed(
        _emulated_skip, 2, args=(layout, "token_mean"), timeout_s=300, env=EMULATED
    )
    skip_case.check(results, layout)
