"""What an engine holds after a relay loads it, read back (issue 21, bad input), with real
processes: two ``megatron-earl serve`` engines started from the same full-state file, one of them
corrupting its first loads (``$EARL_SERVE_FAULT_CORRUPT_LOADS``, fault injection), and a relay
feeding both, plus an engine without ``get_weights_by_name`` (a test double of an SGLang that
predates it).

- ``/get_weights_by_name`` answers the served values (those of the file the engine loaded, as
  SGLang answers them) and refuses an unknown name with a 400 naming it.
- A load that the engine corrupts is found by the relay's read-back, counted and loaded again
  until the engine holds the published values; the other engine of the same relay is loaded and
  checked meanwhile, not after; the engine without the endpoint is loaded, counted as unchecked.

Shares the model, the weights and the relay calls of ``test_relay``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from megatron_earl.rollout.serve.server import FAULT_CORRUPT_LOADS_ENV
from megatron_earl.rollout.sglang.client import EngineRequestError, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.rollout.weights.sync import hf_named_tensors
from megatron_earl.testing.distributed import free_port
from tests.integration.engine_calls import outputs, reported_version
from tests.integration.test_relay import ENV, FAST, GREEDY, MODEL, PROMPT, W, _info, _publish
from tests.integration.test_relay import weights as seeded_weights

pytestmark = pytest.mark.timeout(180)

CORRUPT_LOADS = 3
"""Loads the faulty engine corrupts: three re-loads with backoff (>= 1 s in all) leave time to see
the other engine done while this one is still being loaded."""


class EngineWithoutReadBack:
    """A test double of an SGLang server without ``/get_weights_by_name`` (404): takes weight
    updates and reports their version, nothing else."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.version = "0"
        ready = threading.Event()

        async def main() -> None:
            async def info(request: web.Request) -> web.Response:
                return web.json_response({"weight_version": self.version})

            async def update(request: web.Request) -> web.Response:
                body = await request.json()
                if body.get("weight_version") is not None:
                    self.version = body["weight_version"]
                return web.json_response({"success": True, "message": "ok"})

            async def ok(request: web.Request) -> web.Response:
                return web.json_response({"status": "ok"})

            app = web.Application(client_max_size=1 << 30)
            app.router.add_get("/get_model_info", info)
            app.router.add_post("/update_weights_from_tensor", update)
            app.router.add_post("/pause_generation", ok)
            app.router.add_post("/continue_generation", ok)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            ready.set()
            await asyncio.Event().wait()

        threading.Thread(target=lambda: asyncio.run(main()), daemon=True).start()
        assert ready.wait(30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readback")
    (tmp / "model.json").write_text(json.dumps(MODEL.to_dict()))
    torch.save(W, tmp / "w.pt")
    args = ("--model-config", str(tmp / "model.json"), "--max-seq-len", "64", "--seed", "3")

    def engine(name: str, env: dict[str, str]) -> ServerProcess:
        launch = LaunchConfig(
            model_path=str(tmp / "w.pt"),
            port=free_port(),
            module="megatron_earl.rollout.serve.server",
            extra_args=args,
        )
        return ServerProcess(
            launch, log_path=str(tmp / f"{name}.log"), env={**ENV, **env}, rebind_on_conflict=True
        )

    procs = {
        "good": engine("good", {}),
        "bad": engine("bad", {FAULT_CORRUPT_LOADS_ENV: str(CORRUPT_LOADS)}),
    }
    for p in procs.values():
        p.wait_healthy(timeout_s=120)
    url = {n: p.url for n, p in procs.items()}
    url["old"] = EngineWithoutReadBack(free_port()).url
    fed = (url["bad"], url["good"], url["old"])
    launch = RelayLaunch(free_port(), engines=fed, extra_args=FAST)
    relay = RelayProcess(launch, log_path=str(tmp / "R0.log"), env=ENV)
    try:
        relay.wait_healthy(timeout_s=60, path="/health")
        yield {"url": url, "relays": {"R0": relay}, "tmp": tmp}
    finally:
        relay.stop(stop_timeout_s=10)
        for p in procs.values():
            p.stop(stop_timeout_s=10)


async def _read(url: str, name: str, rows: int) -> list:
    client = SGLangClient(url)
    try:
        return await client.get_weights_by_name(name, rows)
    finally:
        await client.close()


def _wait_applied(relay: str, engine: str) -> dict:
    """The relay's engine states once ``engine`` is loaded and checked (its first apply)."""
    deadline = time.monotonic() + 60
    while (engines := _info(relay)["engines"])[engine]["applies"] < 1:
        assert time.monotonic() < deadline, engines
        time.sleep(0.1)
    return engines


def test_get_weights_by_name_answers_the_served_values(cluster):
    url = cluster["url"]["good"]
    loaded = dict(hf_named_tensors(W, MODEL))  # what the engine loaded from w.pt, HF-named
    names = ["model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"]
    names += ["model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    for name in names:
        assert asyncio.run(_read(url, name, 3)) == loaded[name][:3].float().tolist(), name

    async def raw(method: str, body: dict) -> tuple[int, object]:
        async with aiohttp.ClientSession() as s:
            async with s.request(method, url + "/get_weights_by_name", json=body) as resp:
                return resp.status, await resp.json()

    status, rows = asyncio.run(raw("GET", {"name": "model.embed_tokens.weight"}))
    assert status == 200 and rows == loaded["model.embed_tokens.weight"][:100].tolist()  # default
    status, body = asyncio.run(raw("POST", {"name": "model.embed_tokens.weight", "size": 2}))
    assert status == 400 and "size" in body["error"]["message"]
    with pytest.raises(EngineRequestError) as err:
        asyncio.run(_read(url, "model.layers.7.mlp.up_proj.weight", 3))
    message = str(err.value)
    assert err.value.status == 400 and "'model.layers.7.mlp.up_proj.weight'" in message
    assert "e.g. ['lm_head.weight', 'model.embed_tokens.weight'" in message  # valid names


def test_a_corrupted_load_is_found_counted_and_loaded_again(cluster):
    url, relay = cluster["url"], cluster["relays"]["R0"].url
    published = seeded_weights(21)
    _publish(cluster, published, 1, engines=("good", "bad", "old"))  # all report version 1
    engines = _wait_applied(relay, url["good"])
    good, bad = engines[url["good"]], engines[url["bad"]]
    assert (good["version"], good["failures"], good["mismatches"]) == (1, 0, 0)
    assert bad["applies"] == 0, engines  # the faulty one is still being loaded: nobody waited

    _wait_applied(relay, url["bad"])
    info = _info(relay)
    bad = info["engines"][url["bad"]]
    assert bad["mismatches"] == CORRUPT_LOADS and bad["unverified"] is None
    assert bad["version"] == 1 and bad["failures"] == CORRUPT_LOADS
    assert info["counters"]["engine_mismatches"] == CORRUPT_LOADS
    assert info["counters"]["engine_check_unsupported"] >= 1  # the engine without read-back
    assert info["engines"][url["old"]]["version"] == 1

    hf = dict(hf_named_tensors(published, MODEL))
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        assert asyncio.run(_read(url["bad"], name, 4)) == hf[name][:4].tolist(), name
    assert asyncio.run(reported_version(url["bad"])) == 1
    assert asyncio.run(outputs(url["bad"], PROMPT, GREEDY)) == asyncio.run(
        outputs(url["good"], PROMPT, GREEDY)
    )
