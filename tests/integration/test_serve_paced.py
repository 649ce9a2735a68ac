"""``megatron-earl serve --pace-decode-ms``: the server says it is paced (``/server_info``:
``paced``, ``pacing`` with the decode steps, each >= the pace), its greedy tokens equal an
unpaced server's, and a negative pace is refused at start-up naming the value."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.testing.distributed import free_port

MODEL = ModelConfig(
    num_layers=1,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=256,
    make_vocab_size_divisible_by=64,
)
PACE_MS = 40.0


def _server(tmp_path, pace_ms: float) -> ServerProcess:
    config_path = tmp_path / "model.json"
    config_path.write_text(json.dumps(MODEL.to_dict()))
    launch = LaunchConfig(
        model_path="random",
        port=free_port(),
        module="megatron_earl.rollout.serve.server",
        extra_args=("--model-config", str(config_path), "--seed", "3", "--max-seq-len", "64")
        + (("--pace-decode-ms", str(pace_ms)) if pace_ms else ()),
    )
    log = str(tmp_path / f"server-{pace_ms:g}.log")
    return ServerProcess(
        launch, log_path=log, env={"OMP_NUM_THREADS": "1"}, rebind_on_conflict=True
    )


async def _run(url: str) -> tuple[list[list[int]], dict]:
    client = SGLangClient(url, ClientConfig(backoff_s=0.05))
    requests = [
        GenerateRequest((5, 17, i), SamplingParams(max_new_tokens=8, temperature=0.0))
        for i in range(3)
    ]
    results = await asyncio.gather(*(client.generate(r) for r in requests))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/server_info") as resp:
            info = await resp.json()
    await client.close()
    return [list(r.output_ids) for r in results], info


def test_paced_server_reports_pacing_and_keeps_tokens(tmp_path):
    procs = [_server(tmp_path, pace) for pace in (0.0, PACE_MS)]  # both start at once
    try:
        answers = []
        for proc in procs:
            proc.wait_healthy(timeout_s=120)
            answers.append(asyncio.run(_run(proc.url)))
    finally:
        stop_all(procs, stop_timeout_s=20)
    (base_tokens, base_info), (tokens, info) = answers
    assert tokens == base_tokens
    assert base_info["paced"] is False and base_info["pacing"]["pace_decode_ms"] == 0
    assert info["paced"] is True
    pacing = info["pacing"]
    assert pacing["pace_decode_ms"] == PACE_MS
    assert pacing["decode_steps"] >= 7  # 8 tokens: one from the prefill, 7 decode steps
    assert pacing["min_step_ms"] >= PACE_MS


def test_negative_pace_is_refused():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_earl.rollout.serve.server", "--pace-decode-ms", "-5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--pace-decode-ms must be a finite number >= 0" in out.stderr and "-5" in out.stderr
