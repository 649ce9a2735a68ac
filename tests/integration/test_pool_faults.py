"""The engine pool under engine faults, with real ``serve`` processes (paced decoding, so a
request is in flight for seconds): a stopped engine (SIGSTOP: its socket accepts, nothing
answers) has its in-flight requests moved to the other engine once it fails two health checks,
each answered exactly once; resumed (SIGCONT) it rejoins and the moved requests were aborted on
it. A killed engine's requests fail over at once. Before the health-check move, the stopped
engine held its requests until the client's hour-long request timeout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import FinishType, GenerateRequest
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.sglang.pool import EnginePool, PoolConfig
from megatron_earl.testing.distributed import free_port

pytestmark = pytest.mark.timeout(240)

MODEL = ModelConfig(
    num_layers=1,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=256,
    make_vocab_size_divisible_by=64,
)
NEW_TOKENS = 40
PACE_MS = 50  # a request decodes for >= 2 s


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two paced engines shared by the tests of this file, in its order: the stop test leaves
    both healthy (it waits for the resumed engine to rejoin); the kill test comes last."""
    tmp_path = tmp_path_factory.mktemp("engines")
    (tmp_path / "model.json").write_text(json.dumps(MODEL.to_dict()))
    args = ("--model-config", str(tmp_path / "model.json"), "--seed", "3", "--max-seq-len", "64")
    procs = [
        ServerProcess(
            LaunchConfig(
                model_path="random",
                port=free_port(),
                module="megatron_earl.rollout.serve.server",
                extra_args=(*args, "--pace-decode-ms", str(PACE_MS)),
            ),
            log_path=str(tmp_path / f"e{i}.log"),
            env={"OMP_NUM_THREADS": "1"},
            rebind_on_conflict=True,
        )
        for i in range(2)
    ]
    try:
        for p in procs:
            p.wait_healthy(timeout_s=120)
        yield procs
    finally:
        for p in procs:
            if p.process.poll() is None:
                os.kill(p.process.pid, signal.SIGCONT)
        stop_all(procs, stop_timeout_s=10)


def _pool(procs) -> EnginePool:
    clients = [SGLangClient(p.url, ClientConfig(backoff_s=0.05, max_retries=1)) for p in procs]
    config = PoolConfig(health_interval_s=0.5, health_timeout_s=0.5, unhealthy_after=2)
    return EnginePool(clients, config)


def _requests(n: int) -> list[GenerateRequest]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    return [GenerateRequest((5, 17, i), params, rid=f"r{i}", session=f"s{i}") for i in range(n)]


def test_a_stopped_engines_requests_move_to_another_and_it_rejoins(engines):
    async def run():
        pool = _pool(engines)
        pool.start_health_checks()
        try:
            calls = [asyncio.ensure_future(pool.generate(r)) for r in _requests(4)]
            await asyncio.sleep(0.5)
            held = set(pool._rids.values())
            assert held == {0, 1}  # both engines hold requests
            os.kill(engines[0].process.pid, signal.SIGSTOP)
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*calls), 30)
            moved_after = time.monotonic() - start
            stats = (pool.moved_from_stalled, pool.failovers, list(pool.healthy))
            os.kill(engines[0].process.pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while not all(await pool.check_health()):
                assert time.monotonic() < deadline, "the resumed engine did not rejoin"
                await asyncio.sleep(0.2)
            load = await pool.engines[0].get_server_info()
            return results, moved_after, stats, load
        finally:
            await pool.close()

    results, moved_after, (moved, failovers, healthy), _ = asyncio.run(run())
    assert moved == 2 and failovers == 2 and healthy == [False, True]
    assert len(results) == 4
    for r in results:  # each answered once, whole
        assert r.finish_reason.type is FinishType.LENGTH and len(r.output_ids) == NEW_TOKENS
    assert moved_after < 15


def test_a_killed_engines_requests_fail_over(engines):
    async def run():
        pool = _pool(engines)
        try:
            calls = [asyncio.ensure_future(pool.generate(r)) for r in _requests(4)]
            await asyncio.sleep(0.5)
            engines[1].kill()
            results = await asyncio.wait_for(asyncio.gather(*calls), 30)
            return results, pool.failovers
        finally:
            await pool.close()

    results, failovers = asyncio.run(run())
    assert failovers == 2
    assert all(len(r.output_ids) == NEW_TOKENS for r in results)
