"""SGLang's real router (``sglang-router``, the Rust binary) in front of two ``megatron-earl
serve`` engines with an API key: requests through the router are served (every field the router
adds to a request is accepted by ``serve``), an engine killed while it holds requests loses none
of them (the router retries them on the other engine: every request answered once, with its own
rid), and a router over an unreachable engine fails ``wait_ready`` naming that engine."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.sglang.router import RouterConfig, RouterProcess, build_router_command
from megatron_earl.testing.distributed import free_port

pytest.importorskip("sglang_router", reason="sglang-router is in the [dev] and [router] extras")

KEY = "router-test-key"
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=256,
    make_vocab_size_divisible_by=64,
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engines for the module: the failover test kills engines[0], the unreachable-engine
    test needs one live engine and takes engines[1] (either order works)."""
    tmp_path = tmp_path_factory.mktemp("engines")
    (tmp_path / "model.json").write_text(json.dumps(MODEL.to_dict()))
    procs = [
        ServerProcess(
            LaunchConfig(
                model_path="random",
                port=free_port(),
                api_key=KEY,
                module="megatron_earl.rollout.serve.server",
                extra_args=(
                    "--model-config",
                    str(tmp_path / "model.json"),
                    "--max-seq-len",
                    "256",
                    "--max-batch-size",
                    "4",
                    # a decode step lasts >= 5 ms: a 120-token request runs >= 0.6 s, so the
                    # failover test sees the victim hold requests however fast the machine is
                    "--pace-decode-ms",
                    "5",
                ),
            ),
            log_path=str(tmp_path / f"engine{i}.log"),
            env={"OMP_NUM_THREADS": "1"},
            rebind_on_conflict=True,
        )
        for i in range(2)
    ]
    try:
        for proc in procs:
            proc.wait_healthy(timeout_s=120)
        yield procs
    finally:
        stop_all(procs, stop_timeout_s=20)


async def _load(url: str) -> int:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as s, s.get(url + "/get_load") as resp:
        return (await resp.json())["num_reqs"]


def test_command():
    cmd = build_router_command(
        RouterConfig(port=31000, policy="round_robin", api_key="k"), ["http://a:1", "http://b:2"]
    )
    assert cmd[1:6] == [
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        "http://a:1",
        "http://b:2",
    ]
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[-2:] == ["--api-key", "k"]
    with pytest.raises(ValueError, match="policy 'fastest' is not one of"):
        RouterConfig(policy="fastest")
    with pytest.raises(ValueError, match=r"engine URLs \['a:1'\] must start with http"):
        build_router_command(RouterConfig(), ["a:1"])


def test_requests_through_the_router_survive_a_killed_engine(engines, tmp_path):
    """The victim holds requests when it is killed; each of them is retried -- by the router, or,
    when the router answers with its upstream error (HTTP 500 ``call_upstream_request_error``),
    by the client through the router -- on the surviving engine: every request answered once."""
    config = RouterConfig(port=free_port(), policy="round_robin", api_key=KEY)
    with RouterProcess(
        config, [e.url for e in engines], log_path=str(tmp_path / "r.log"), rebind_on_conflict=True
    ) as router:
        router.wait_ready(timeout_s=60)

        async def body():
            client = SGLangClient(router.url, ClientConfig(api_key=KEY, max_retries=5))
            sampling = SamplingParams(max_new_tokens=120, temperature=0.0)
            requests = [GenerateRequest((1, 2, 3, i), sampling, rid=f"req-{i}") for i in range(12)]
            tasks = [asyncio.create_task(client.generate(r)) for r in requests]
            deadline = time.monotonic() + 30
            while (held := await _load(engines[0].url)) == 0:  # the victim holds requests
                failed = [t.exception() for t in tasks if t.done() and t.exception()]
                assert not failed, f"requests failed before the kill: {failed[:2]}"
                assert not all(t.done() for t in tasks), "every request ended before the kill"
                loads = [await _load(e.url) for e in engines]
                assert time.monotonic() < deadline, f"the victim got no request; loads {loads}"
                await asyncio.sleep(0.02)
            engines[0].kill()
            results = await asyncio.gather(*tasks)
            await client.close()
            return held, results, client.retries

        held, results, retries = asyncio.run(body())
    assert held > 0 and retries >= 0  # retries: by the client (which one retries varies)
    assert sorted(r.rid for r in results) == sorted(f"req-{i}" for i in range(12))
    assert all(len(r.output_ids) == 120 for r in results)


def test_unreachable_engine_is_named(engines, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    config = RouterConfig(port=free_port(), api_key=KEY)
    log = str(tmp_path / "r.log")
    with RouterProcess(
        config, [engines[1].url, dead], log_path=log, rebind_on_conflict=True
    ) as router:
        with pytest.raises((TimeoutError, RuntimeError), match=dead.replace(".", r"\.")):
            router.wait_ready(timeout_s=5)
