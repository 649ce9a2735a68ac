"""The relay weight service with real processes: ``megatron-earl serve`` engines fed by
``megatron-earl relay`` processes in a tree (root R0; R1 pulls from R0 and feeds e0, e1; R2
pulls from R1 or R0 and feeds e2), the trainer's ``relay`` transport publishing once to R0.

- A version published once reaches every engine, which then generates exactly what an engine
  started with those weights generates; the trainer sent one copy whatever the engine count.
- A relay behind a corrupting link refuses the bad bucket (checksum), pulls it again and commits
  the trainer's bytes; the counters say so.
- A version is complete or absent: a commit that misses a bucket is refused, nothing is served.
- A killed relay stops only its own engines' updates (R2 goes on through R0; the async publish
  does not wait); restarted, it pulls the newest version and its engines get it. A dead engine
  makes a synchronous publish fail naming it; restarted, its relay loads the newest version.
- A resumed trainer (a newer publisher generation) publishes a lower version: the relays take it
  and every engine serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.rollout.engine import EngineError
from megatron_earl.rollout.sglang.client import SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.rollout.weights.relay.versions import digest
from megatron_earl.rollout.weights.sync import hf_named_tensors
from megatron_earl.rollout.weights.transports import build_transport
from megatron_earl.testing.distributed import free_port
from tests.integration.engine_calls import outputs, reported_version

pytestmark = pytest.mark.timeout(300)

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=256,
    make_vocab_size_divisible_by=64,
)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
PROMPT = (5, 17, 99, 3, 42, 7)
FAST = ("--engine-check-s", "0.3", "--poll-wait-s", "2", "--lease-s", "30")
ENV = {"OMP_NUM_THREADS": "1"}


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.3 for k, s in global_shapes(MODEL).items()}


W = weights(11)


class CorruptingLink:
    """A test double of a faulty link in front of a relay: forwards every GET, and flips one
    byte of the first copy of each bucket it passes on."""

    def __init__(self, upstream: str, port: int) -> None:
        self.upstream, self.port = upstream, port
        self.corrupted: set[str] = set()
        self._ready = threading.Event()
        threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True).start()
        assert self._ready.wait(30)

    async def _main(self) -> None:
        session = aiohttp.ClientSession()

        async def forward(request: web.Request) -> web.Response:
            async with session.get(self.upstream + request.path_qs) as resp:
                body = await resp.read()
                if "/buckets/" in request.path and request.path not in self.corrupted:
                    self.corrupted.add(request.path)
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                keep = {
                    k: v
                    for k, v in resp.headers.items()
                    if k.lower().startswith(("x-", "content-type"))
                }
                return web.Response(status=resp.status, body=body, headers=keep)

        app = web.Application()
        app.router.add_get("/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        await asyncio.Event().wait()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("relay")
    (tmp / "model.json").write_text(json.dumps(MODEL.to_dict()))
    torch.save(W, tmp / "w.pt")
    common = ("--model-config", str(tmp / "model.json"), "--max-seq-len", "64")
    serve = "megatron_earl.rollout.serve.server"

    def engine(name: str, path: str) -> ServerProcess:
        launch = LaunchConfig(
            model_path=path, port=free_port(), module=serve, extra_args=(*common, "--seed", "3")
        )
        return ServerProcess(
            launch, log_path=str(tmp / f"{name}.log"), env=ENV, rebind_on_conflict=True
        )

    procs: dict[str, ServerProcess] = {"ref": engine("ref", str(tmp / "w.pt"))}
    procs.update({f"e{i}": engine(f"e{i}", "random") for i in range(3)})
    for p in procs.values():
        p.wait_healthy(timeout_s=120)
    url = {n: p.url for n, p in procs.items()}

    def relay(name: str, port: int, upstreams=(), engines=(), wait=True) -> RelayProcess:
        launch = RelayLaunch(
            port, upstreams=tuple(upstreams), engines=tuple(engines), extra_args=FAST
        )
        r = RelayProcess(launch, log_path=str(tmp / f"{name}.log"), env=ENV)
        if wait:
            r.wait_healthy(timeout_s=60, path="/health")
        return r

    ports = {n: free_port() for n in ("R0", "R1", "R2", "R3", "link")}
    root, r1 = (f"http://127.0.0.1:{ports[n]}" for n in ("R0", "R1"))
    link = CorruptingLink(root, ports["link"])
    relays = {  # started together, then waited for
        "R0": relay("R0", ports["R0"], wait=False),
        "R1": relay("R1", ports["R1"], [root], [url["e0"], url["e1"]], wait=False),
        "R2": relay("R2", ports["R2"], [r1, root], [url["e2"]], wait=False),
        "R3": relay("R3", ports["R3"], [f"http://127.0.0.1:{link.port}"], wait=False),
    }
    for r in relays.values():
        r.wait_healthy(timeout_s=60, path="/health")
    assert (relays["R0"].url, relays["R1"].url) == (root, r1)
    try:
        yield {"procs": procs, "url": url, "relays": relays, "relay": relay, "ports": ports,
               "engine": engine, "tmp": tmp}  # fmt: skip
    finally:
        stop_all([*relays.values(), *procs.values()], stop_timeout_s=10)


def _settings(tree, **kw) -> SGLangConfig:
    base = {"relay_urls": (tree["relays"]["R0"].url,), "bucket_bytes": 16 << 10}
    return SGLangConfig(weight_update="relay", **{**base, "relay_timeout_s": 60, **kw})


def _transport(tree, asynchronous=False, **kw):
    transport = build_transport(_settings(tree, **kw), MODEL, tree["tmp"])
    transport.asynchronous = asynchronous
    return transport


def _publish(tree, full, version: int, engines=("e0", "e1", "e2"), transport=None, **kw):
    """One publish by ``transport`` (default: a new synchronous one, whose push waits for the
    engines)."""
    transport = transport or _transport(tree, **kw)

    async def run():
        clients = [SGLangClient(tree["url"][e]) for e in engines]
        try:
            return await transport.push(clients, hf_named_tensors(full, MODEL), version)
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    return asyncio.run(run())


async def _outputs(url: str):
    return await outputs(url, PROMPT, GREEDY)


def _wait_version(url: str, version: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(EngineError):  # restarting engines do not answer for a while
            if asyncio.run(reported_version(url)) == version:
                return
        assert time.monotonic() < deadline, f"{url} never reported version {version}"
        time.sleep(0.2)


def _info(url: str) -> dict:
    async def get():
        async with aiohttp.ClientSession() as s, s.get(url + "/relay_info") as resp:
            return await resp.json()

    return asyncio.run(get())


def test_one_publish_reaches_every_engine_and_equals_a_direct_load(tree):
    stats = _publish(tree, W, 1)
    nbytes = sum(t.numel() * t.element_size() for t in W.values())
    assert stats.num_buckets > 1
    assert nbytes <= stats.bytes_sent < 1.1 * nbytes  # one copy (plus safetensors headers)
    ref = asyncio.run(_outputs(tree["url"]["ref"]))
    for e in ("e0", "e1", "e2"):
        assert asyncio.run(reported_version(tree["url"][e])) == 1
        ids, logprobs = asyncio.run(_outputs(tree["url"][e]))
        assert ids == ref[0]
        assert logprobs == pytest.approx(ref[1], abs=1e-6)
    assert _info(tree["relays"]["R0"].url)["counters"]["published"] == 1


def test_a_bucket_that_fails_its_checksum_is_refused_and_pulled_again(tree):
    _publish(tree, weights(12), 2)
    r3 = tree["relays"]["R3"].url
    deadline = time.monotonic() + 60
    while _info(r3)["newest_version"] != 2:
        assert time.monotonic() < deadline, _info(r3)
        time.sleep(0.2)
    counters = _info(r3)["counters"]
    assert counters["checksum_refused"] >= 1 and counters["repulls"] >= 1

    async def bucket(url: str) -> bytes:
        async with aiohttp.ClientSession() as s, s.get(url + "/versions/2/buckets/0") as resp:
            return await resp.read()

    assert digest(asyncio.run(bucket(r3))) == digest(asyncio.run(bucket(tree["relays"]["R0"].url)))


def test_a_version_is_complete_or_absent(tree):
    root = tree["relays"]["R0"].url
    info = _info(root)
    before, gen = info["newest_version"], info["newest_generation"]
    v = before + 1

    async def run():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{root}/versions/{v}/begin", params={"generation": gen}) as resp:
                assert resp.status == 200
            data = b"\x00" * 64
            bad = {"X-Sha256": digest(b"other")}
            async with s.put(f"{root}/versions/{v}/buckets/0", data=data, headers=bad) as resp:
                assert resp.status == 422 and "sha256" in (await resp.json())["error"]["message"]
            good = {"X-Sha256": digest(data)}
            async with s.put(f"{root}/versions/{v}/buckets/0", data=data, headers=good) as resp:
                assert resp.status == 200
            manifest = {"version": v, "generation": gen, "buckets": [
                {"sha256": digest(data), "nbytes": 64, "tensors": 1},
                {"sha256": digest(b"never sent"), "nbytes": 10, "tensors": 1},
            ]}  # fmt: skip
            async with s.post(f"{root}/versions/{v}/commit", json=manifest) as resp:
                assert (
                    resp.status == 409 and "missing [1]" in (await resp.json())["error"]["message"]
                )
            after = {"after": str(before), "after_generation": str(gen)}
            async with s.get(f"{root}/versions/latest", params=after) as resp:
                assert resp.status == 204

    asyncio.run(run())
    assert _info(root)["newest_version"] == before and _info(root)["staged"] == [v]


def test_a_dead_relay_or_engine_stops_only_its_own(tree):
    relays, url = tree["relays"], tree["url"]
    run = _transport(tree, asynchronous=True)  # an asynchronous run's transport:
    _publish(tree, weights(13), 9, transport=run)  # its first push waits for the engines
    relays["R1"].kill()
    start = time.perf_counter()
    stats = _publish(tree, weights(13), 10, transport=run)  # the next ones do not
    assert time.perf_counter() - start < 30 and stats.num_buckets > 1
    _wait_version(url["e2"], 10)  # R2 pulls from R0 when R1 is gone
    assert asyncio.run(reported_version(url["e0"])) != 10  # e0, e1: their relay is dead
    relays["R1"] = tree["relay"](
        "R1b", tree["ports"]["R1"], [relays["R0"].url], [url["e0"], url["e1"]]
    )
    _wait_version(url["e0"], 10)
    _wait_version(url["e1"], 10)

    tree["procs"]["e2"].kill()
    with pytest.raises(EngineError, match=url["e2"]):
        _publish(tree, weights(14), 11, relay_timeout_s=3)
    assert asyncio.run(reported_version(url["e0"])) == 11  # the others got it
    port = int(url["e2"].rsplit(":", 1)[1])
    launch = dataclasses.replace(tree["procs"]["e2"].config, port=port)
    tree["procs"]["e2"] = ServerProcess(launch, log_path=str(tree["tmp"] / "e2b.log"), env=ENV)
    tree["procs"]["e2"].wait_healthy(timeout_s=120)
    _wait_version(url["e2"], 11)  # its relay loads the newest version into the new engine
    ids, _ = asyncio.run(_outputs(url["e2"]))
    assert ids == asyncio.run(_outputs(url["e0"]))[0]
    info = _info(relays["R2"].url)["engines"][url["e2"]]
    assert info["failures"] >= 1 and info["version"] == 11


def test_a_resumed_trainer_republishes_a_lower_version_and_every_engine_takes_it(tree):
    """A trainer resumed from an older checkpoint publishes its policy version again (lower than
    its crashed predecessor's newest): a newer generation, which the relays take (dropping the
    crashed run's newer versions) and load into every engine."""
    root = tree["relays"]["R0"].url
    crashed = _info(root)["newest_version"]
    _publish(tree, W, crashed - 3)  # a new transport: a new publisher generation
    ref = asyncio.run(_outputs(tree["url"]["ref"]))
    for e in ("e0", "e1", "e2"):
        assert asyncio.run(reported_version(tree["url"][e])) == crashed - 3
        assert asyncio.run(_outputs(tree["url"][e]))[0] == ref[0]
    info = _info(root)
    assert info["newest_version"] == crashed - 3 and crashed not in info["committed"]
