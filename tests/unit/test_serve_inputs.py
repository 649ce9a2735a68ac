"""Input rules of ``megatron-earl serve`` and its client that need no model: the one
``weight_version`` parser (integers and integer strings; non-finite, fractional and boolean
values refused), ``HFReader(confined=True)`` (no file outside the directory is opened) and the
client's single attempt at ``update_weights_from_distributed`` (the trainer broadcasts each
bucket once, so a retried receive would wait for a broadcast that never comes)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file

from megatron_earl.convert.hf_io import HFReader
from megatron_earl.rollout.serve.generate_api import BadRequest, parse_weight_version
from megatron_earl.rollout.sglang.client import ClientConfig, EngineError, SGLangClient


@pytest.mark.parametrize("value, want", [("3", 3), (" 12 ", 12), (7, 7), (4.0, 4), ("-1", -1)])
def test_weight_versions_parse(value, want):
    assert parse_weight_version(value) == want


@pytest.mark.parametrize(
    "value", [math.inf, -math.inf, math.nan, 2.5, "2.5", "inf", "1e400", True, None, [], "", "x"]
)
def test_non_integral_weight_versions_are_refused(value):
    with pytest.raises(BadRequest, match="weight_version"):
        parse_weight_version(value)


def _index(directory, files: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))


def test_a_confined_reader_opens_nothing_outside_its_directory(tmp_path):
    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.zeros(2)}, outside)
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in (str(outside), "../outside.safetensors", "/nonexistent/x.safetensors"):
        _index(hf, {"w": name})
        if "nonexistent" not in name:
            HFReader(hf)  # unconfined (a trusted local conversion): reads it
        with pytest.raises(PermissionError, match="resolves outside"):
            HFReader(hf, confined=True)
    (hf / "link.safetensors").symlink_to(outside)
    _index(hf, {"w": "link.safetensors"})
    with pytest.raises(PermissionError, match="resolves outside"):
        HFReader(hf, confined=True)
    (hf / "model.safetensors.index.json").unlink()
    (hf / "model.safetensors").symlink_to(outside)
    with pytest.raises(PermissionError, match="resolves outside"):
        HFReader(hf, confined=True)
    (hf / "model.safetensors").unlink()
    save_file({"w": torch.ones(2)}, hf / "inside.safetensors")
    _index(hf, {"w": "inside.safetensors"})
    assert HFReader(hf, confined=True).read(["w"])["w"].tolist() == [1.0, 1.0]


def test_update_weights_from_distributed_is_sent_once():
    calls: dict[str, int] = {}

    async def unavailable(request: web.Request) -> web.Response:
        calls[request.path] = calls.get(request.path, 0) + 1
        return web.Response(status=503)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/{path}", unavailable)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        config = ClientConfig(max_retries=2, backoff_s=0.01, backoff_max_s=0.01)
        client = SGLangClient(f"http://127.0.0.1:{port}", config)
        try:
            with pytest.raises(EngineError):
                await client.update_weights_from_distributed(["w"], ["float32"], [[2]])
            with pytest.raises(EngineError):  # other weight calls keep their retries
                await client.update_weights_from_disk("/x")
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())
    assert calls == {"/update_weights_from_distributed": 1, "/update_weights_from_disk": 3}
