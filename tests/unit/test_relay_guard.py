"""What a hostile caller cannot do to a relay (``relay/server.py``, its module docstring): skip
the key with another method or path spelling, pin the relay to a generation from the future,
hang a long poll with ``wait_s=nan``, crash a handler with deep JSON, or serve off loopback
without a key. One in-process relay with no engines and no upstream."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import torch
import yarl
from aiohttp import web

from megatron_earl.rollout.weights.relay.publisher import RelayPublisher
from megatron_earl.rollout.weights.relay.server import RelayServer, RelaySettings, exposure_problem
from megatron_earl.rollout.weights.relay.wire import API_KEY_ENV

KEY = "relay-key-1"
NAMED = [("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4))]


@contextlib.asynccontextmanager
async def _relay(**settings):
    """An in-process relay on a free loopback port; yields (server, base URL)."""
    server = RelayServer(RelaySettings(**settings))
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield server, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
PATHS = (
    "/relay_info",
    "/versions/latest",
    "/versions/1/begin",
    "/versions/1/buckets/0",
    "/versions/1/commit",
    "/engines/release",
    "/nowhere",
    "/health/../relay_info",
    "/health%2F..%2Frelay_info",
    "//relay_info",
    "/relay_info/",
)


def test_every_method_and_spelling_needs_the_key_but_the_health_probe():
    async def body():
        async with _relay(api_key=KEY) as (_, url), aiohttp.ClientSession() as s:
            for path in PATHS:
                for method in METHODS:
                    for headers in ({}, {"Authorization": f"Bearer {KEY}x"}):
                        target = yarl.URL(url + path, encoded=True)
                        async with s.request(method, target, headers=headers) as resp:
                            assert resp.status == 401, (method, path, resp.status)
            async with s.get(url + "/health") as resp:
                assert resp.status == 200
            async with s.get(url + "/relay_info", headers={"Authorization": f"bearer {KEY}"}) as r:
                assert r.status == 200

    _run(body())


def test_a_generation_from_the_future_is_refused_and_the_trainers_next_publish_lands(
    monkeypatch,
):
    """The probe's poisoning: one begin with ``generation=10**15`` (year 33658). Refused with
    400; nothing staged; the trainer's publish of its next version lands as the newest."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)

    async def body():
        async with _relay() as (server, url), aiohttp.ClientSession() as s:
            publisher = RelayPublisher([url])
            await publisher.publish(NAMED, version=3, bucket_bytes=1 << 20)
            async with s.post(f"{url}/versions/4/begin", params={"generation": 10**15}) as r:
                assert r.status == 400
                message = (await r.json())["error"]["message"]
                assert "generation 1000000000000000 is ahead of this relay's clock" in message
            assert server.store.staged_versions() == []
            await publisher.publish(NAMED, version=4, bucket_bytes=1 << 20)
            latest = server.store.latest()
            assert (latest.version, latest.generation) == (4, publisher.generation)
            # Within the stated skew a later generation is taken (a resumed trainer on a node
            # whose clock runs a little ahead).
            ahead = publisher.generation + 1000
            async with s.post(f"{url}/versions/9/begin", params={"generation": ahead}) as r:
                assert r.status == 200
            async with s.post(f"{url}/versions/9/begin", params={"generation": "x"}) as r:
                assert r.status == 400 and "generation must be an integer" in await r.text()

    _run(body())


@pytest.mark.parametrize("wait", ["nan", "inf", "-1", "soon"])
def test_a_long_poll_with_a_bad_wait_is_refused(wait):
    async def body():
        async with _relay() as (_, url), aiohttp.ClientSession() as s:
            async with s.get(f"{url}/versions/latest", params={"wait_s": wait}) as resp:
                assert resp.status == 400
                assert (
                    f"wait_s must be a finite number of seconds >= 0, got {wait!r}"
                    in (await resp.json())["error"]["message"]
                )

    _run(body())


def test_shutdown_answers_pending_long_polls_at_once():
    """A long poll waits up to 60 s; at shutdown it answers 204 before aiohttp waits for it
    (the probe saw a relay take 61 s to exit on SIGTERM with one pending)."""

    async def body():
        server = RelayServer(RelaySettings())
        runner = web.AppRunner(server.app(), shutdown_timeout=120)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        async with aiohttp.ClientSession() as s:
            poll = asyncio.create_task(s.get(f"{url}/versions/latest", params={"wait_s": "60"}))
            await asyncio.sleep(0.3)
            assert not poll.done()
            loop = asyncio.get_running_loop()
            start = loop.time()
            await runner.cleanup()
            resp = await poll
            assert resp.status == 204
            assert loop.time() - start < 30  # not the poll's 60 s nor the shutdown timeout

    _run(body())


def test_deep_or_malformed_json_bodies_get_400():
    deep = "[" * 100_000 + "]" * 100_000

    async def body():
        async with _relay() as (_, url), aiohttp.ClientSession() as s:
            for path in ("/versions/1/commit", "/engines/release"):
                for text in (deep, "{", "[1, 2]"):
                    async with s.post(url + path, data=text) as resp:
                        assert resp.status == 400, (path, text[:5], resp.status)
                        assert "error" in await resp.json()
            async with s.post(url + "/versions/1/commit", data=deep) as resp:
                assert resp.status == 400
                assert "nested too deeply" in (await resp.json())["error"]["message"]

    _run(body())


def test_a_relay_off_loopback_needs_a_key_or_a_declared_trusted_network():
    assert exposure_problem("127.0.0.1", None, False) is None
    assert exposure_problem("::1", None, False) is None
    assert exposure_problem("localhost", None, False) is None
    assert exposure_problem("0.0.0.0", KEY, False) is None
    assert exposure_problem("0.0.0.0", None, True) is None
    for host in ("0.0.0.0", "10.0.0.5", "relay-0.cluster"):
        problem = exposure_problem(host, None, False)
        assert problem is not None and f"--host {host}" in problem and API_KEY_ENV in problem


def test_the_command_refuses_to_serve_off_loopback_without_a_key(monkeypatch, capsys):
    from megatron_earl.rollout.weights.relay.server import main

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["--host", "0.0.0.0", "--port", "1"]) == 2
    assert "is reachable from other machines" in capsys.readouterr().out
    assert main(["--port", "1", "--max-clock-skew-s", "nan"]) == 2
    assert "max_clock_skew_s must be finite and > 0, got nan" in capsys.readouterr().out
