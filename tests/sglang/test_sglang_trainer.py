"""The trainer (2 ranks under torchrun, the switching demo config at 2 layers) on two real SGLang
engines: weights pushed before every rollout with each protocol SGLang reads here (tensor with
SGLang's own payload, distributed over gloo through SGLang's router, disk), in the asynchronous
loop with ``max_staleness=1``, and through one relay feeding both engines. Every run completes,
loses no trajectory, leaves both engines serving the last pushed version, and its rollout
log-probs are the trainer's within the fp32 bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.router import RouterConfig, RouterProcess
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.testing.distributed import free_port
from tests.sglang.conftest import KEY, MODEL_RUN, ROOT
from tests.tolerances import fp32_tol, gpt_terms

RUN = (
    "sft.steps=0",
    "eval.num_prompts=0",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "checkpoint.interval=0",
    "logging.tensorboard=false",
    "logging.progress=false",
    "layouts.experience=tp1cp1pp1dp2",
    *MODEL_RUN,
)
SGLANG_PAYLOAD = (
    "rollout.sglang.weight_update=tensor",
    "rollout.sglang.tensor_payload=sglang",
    "rollout.sglang.tensor_load_format=flattened_bucket",
)
PROTOCOLS = {
    "tensor-sglang": SGLANG_PAYLOAD,
    "distributed": ("rollout.sglang.weight_update=distributed",),
    "disk": ("rollout.sglang.weight_update=disk",),
}
LOGPROB_SCALE = 30.0
"""Magnitude of the compared log-probs: a token below -30 nats (p < 1e-13) is not sampled in the
few thousand draws of a run."""


def train(urls, tmp_path: Path, name: str, *overrides: str, steps: int = 2) -> list[dict]:
    """A run on the engines ``urls``; its metrics records."""
    result = subprocess.run(
        [
            sys.executable, "-m", "megatron_earl.cli.main", "train", "--nproc", "2",
            "--config", str(ROOT / "configs" / "demo_cpu_switching.yaml"), *RUN,
            f"steps={steps}", f"output_dir={tmp_path}", f"name={name}",
            "rollout.engine=sglang", f"rollout.engine_urls=[{','.join(urls)}]", *overrides,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "SGLANG_API_KEY": KEY},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]


def versions(urls) -> list[int]:
    async def read() -> list[int]:
        clients = [SGLangClient(u, ClientConfig(api_key=KEY)) for u in urls]
        try:
            await asyncio.gather(*(c.get_model_info() for c in clients))
            return [c.weight_version for c in clients]
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    return asyncio.run(read())


def check_numerics(records: list[dict], run_config) -> None:
    """The engines' log-probs of the sampled tokens are the trainer's recomputation of the same
    weights within the fp32 bound of two summation orders of a forward over the context."""
    bound = fp32_tol(gpt_terms(run_config.model, run_config.rollout.max_context), LOGPROB_SCALE)
    for r in records:
        assert r["rollout/logprob_mismatch"] <= bound, (r["step"], r["rollout/logprob_mismatch"])


@pytest.mark.parametrize("protocol", [*PROTOCOLS, "colocated"])
def test_the_trainer_pushes_and_rolls_out_on_real_sglang(engines, run_config, tmp_path, protocol):
    """``colocated``: tensor-sglang with the engines' memory released after each rollout and
    resumed around the next push, in SGLang users' order (on CPU SGLang answers these calls
    without freeing anything: ``--enable-memory-saver`` needs libcuda; their effect is tested on
    ``serve``, tests/integration/test_trainer_sglang.py)."""
    urls = [e.url for e in engines]
    with contextlib.ExitStack() as stack:
        extra = list(PROTOCOLS.get(protocol, SGLANG_PAYLOAD))
        if protocol == "colocated":
            extra.append("rollout.sglang.colocated=true")
        if protocol == "distributed":  # generation through SGLang's router, as a cluster runs
            router = stack.enter_context(
                RouterProcess(
                    RouterConfig(port=free_port(), api_key=KEY),
                    urls,
                    log_path=str(tmp_path / "router.log"),
                    rebind_on_conflict=True,
                )
            )
            router.wait_ready(timeout_s=60)
            extra.append(f"rollout.sglang.router_url={router.url}")
        if protocol == "disk":
            extra.append(f"rollout.sglang.weight_dir={tmp_path / 'weights'}")
        records = train(urls, tmp_path, protocol, *extra)
        served = versions(urls)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/trajectories"] == 16 and r["rollout/failed"] == 0
        assert r["sync/weight_push_s"] >= r["sync/weight_transfer_s"] > 0
        assert r["sync/weight_push_bytes"] > 0
        assert r["rollout/engine_retries"] == r["rollout/engine_failovers"] == 0
    assert served == [1, 1]  # pushed before step 2's rollout: the weights after one step
    check_numerics(records, run_config)
    if protocol == "colocated":
        assert all(r["rollout/memory_release_s"] > 0 for r in records)
        assert records[1]["sync/memory_resume_weights_s"] > 0
        assert records[1]["sync/memory_resume_kv_cache_s"] > 0


def test_async_with_staleness_1_on_real_sglang(engines, run_config, tmp_path):
    """Generation runs a step ahead of training; every group produced is consumed, discarded or
    buffered, each step takes its 4 groups, none more than one step old."""
    urls = [e.url for e in engines]
    records = train(
        urls, tmp_path, "async", "rollout.mode=async", "rollout.max_staleness=1",
        *SGLANG_PAYLOAD, steps=3,
    )  # fmt: skip
    for step, r in enumerate(records, start=1):
        counts = {
            k: r[f"rollout/async_{k}_groups"]
            for k in ("started", "produced", "consumed", "discarded", "buffered", "in_flight")
        }
        assert counts["produced"] == counts["consumed"] + counts["discarded"] + counts["buffered"]
        assert counts["started"] == counts["produced"] + counts["in_flight"]
        assert counts["consumed"] == step * 4, (step, counts)
        lags = r["rollout/staleness_traj_lag0"] + r["rollout/staleness_traj_lag1"]
        assert lags == r["rollout/trajectories"] == 16
    served = versions(urls)
    assert served[0] == served[1] >= 2  # the last push came before step 3's rollout or after it


def test_one_relay_feeds_both_real_sglang_engines(engines, run_config, tmp_path):
    """The trainer publishes to one relay, which loads both engines itself (SGLang's own payload:
    the relay is on the engines' host); the synchronous loop waits for both to report the
    version."""
    urls = [e.url for e in engines]
    env = {"OMP_NUM_THREADS": "1", "SGLANG_API_KEY": KEY}
    relay = RelayProcess(
        RelayLaunch(free_port(), engines=tuple(urls)),
        log_path=str(tmp_path / "relay.log"),
        env=env,
    )
    try:
        relay.wait_healthy(timeout_s=60, path="/health")
        records = train(
            urls, tmp_path, "relay", "rollout.sglang.weight_update=relay",
            f"rollout.sglang.relay_urls=[{relay.url}]",
        )  # fmt: skip
        served = versions(urls)
    finally:
        relay.stop(stop_timeout_s=10)
    for r in records:
        assert r["rollout/trajectories"] == 16 and r["rollout/failed"] == 0
    assert served == [1, 1]
    check_numerics(records, run_config)
