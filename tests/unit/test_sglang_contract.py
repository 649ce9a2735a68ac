"""Contract test: every request body the SGLang client sends fits SGLang's own request classes.

The classes are read (``ast``, never imported) from ``sglang/srt/managers/io_struct.py`` and
``sglang/srt/sampling/sampling_params.py`` of the pinned wheel (``SGLANG_PINNED``), downloaded with
pip into a cache directory (``$MEGATRON_EARL_CACHE`` or ``~/.cache/megatron_earl``). Each body may
only use fields the class declares and must give every field without a default. The client talks
to a small in-process recorder (the real server is exercised in tests/integration/test_serve.py).
Skipped, with the reason, when the wheel cannot be fetched.
"""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from aiohttp import web

from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.sglang_client import SGLANG_PINNED, ClientConfig, SGLangClient
from megatron_earl.rollout.weight_sync import serialize_named_tensors

# Endpoint -> request class in io_struct.py (None: no body is sent).
ENDPOINTS = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/flush_cache": None,
    "/health": None,
    "/get_model_info": None,
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}


def _cache_dir() -> Path:
    root = os.environ.get("MEGATRON_EARL_CACHE") or Path.home() / ".cache" / "megatron_earl"
    return Path(root) / f"sglang-{SGLANG_PINNED}"


@pytest.fixture(scope="module")
def sglang_sources() -> dict[str, str]:
    cache = _cache_dir()
    wheels = sorted(cache.glob("sglang-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "-d",
            str(cache),
            f"sglang=={SGLANG_PINNED}",
        ]
        try:
            subprocess.run(cmd, check=True, timeout=300, capture_output=True)
        except (subprocess.SubprocessError, OSError) as err:
            pytest.skip(
                f"cannot fetch the sglang=={SGLANG_PINNED} wheel from PyPI ({err}); "
                "the contract test needs it"
            )
        wheels = sorted(cache.glob("sglang-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        return {
            "io_struct": zf.read("sglang/srt/managers/io_struct.py").decode(),
            "sampling": zf.read("sglang/srt/sampling/sampling_params.py").decode(),
        }


def class_fields(source: str) -> dict[str, dict[str, bool]]:
    """{class: {field: has_default}} of every class in ``source``, including fields inherited
    from classes of the same file."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, dict[str, bool]] = {}

    def fields(name: str) -> dict[str, bool]:
        if name in out:
            return out[name]
        node = classes[name]
        result: dict[str, bool] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                result.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                result[stmt.target.id] = stmt.value is not None
        out[name] = result
        return result

    for name in classes:
        fields(name)
    return out


async def _record_client_requests() -> list[tuple[str, str, object]]:
    async def handler(request: web.Request) -> web.Response:
        if request.path == "/generate":
            meta = {
                "id": "r",
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": 2,
                "weight_version": "0",
                "output_token_logprobs": [[-0.5, 3, None]],
            }
            return web.json_response({"text": "", "output_ids": [3], "meta_info": meta})
        if request.path == "/get_model_info":
            return web.json_response({"weight_version": "0"})
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    sent: list[tuple[str, str, object]] = []
    client = SGLangClient(f"http://127.0.0.1:{port}", ClientConfig(api_key="k"))
    client.on_request = lambda method, path, body: sent.append((method, path, body))
    params = SamplingParams(
        max_new_tokens=4,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        stop_token_ids=(2,),
        stop=("\n",),
        seed=3,
    )
    await client.generate(GenerateRequest((1, 2), params, rid="x"))
    await client.abort("x")
    await client.abort_all()
    await client.pause("retract")
    await client.flush_cache()
    await client.update_weights_from_tensor(
        [serialize_named_tensors([("lm_head.weight", torch.zeros(2, 2))])], weight_version=4
    )
    await client.init_weights_update_group("127.0.0.1", 1234, 1, 2, backend="gloo")
    await client.update_weights_from_distributed(["w"], ["float32"], [[2, 2]], weight_version=5)
    await client.destroy_weights_update_group()
    await client.update_weights_from_disk("/ckpt", weight_version=6)
    await client.resume()
    await client.health()
    await client.get_model_info()
    await client.close()
    await runner.cleanup()
    return sent


def test_client_requests_match_sglang_io_struct(sglang_sources):
    io_classes = class_fields(sglang_sources["io_struct"])
    sampling_fields = class_fields(sglang_sources["sampling"])["SamplingParams"]
    sent = asyncio.run(_record_client_requests())
    assert {path for _, path, _ in sent} == set(ENDPOINTS), "every endpoint must be exercised"
    for method, path, body in sent:
        cls = ENDPOINTS[path]
        if cls is None:
            assert body is None, f"{method} {path} sends no body in SGLang, got {body}"
            continue
        fields = io_classes[cls]
        unknown = set(body) - set(fields)
        assert not unknown, f"{path}: fields {sorted(unknown)} are not in sglang {cls}"
        missing = {f for f, has_default in fields.items() if not has_default} - set(body)
        assert not missing, f"{path}: required fields {sorted(missing)} of {cls} not sent"
        if path == "/generate":
            extra = set(body["sampling_params"]) - set(sampling_fields)
            assert not extra, f"sampling_params {sorted(extra)} not in sglang SamplingParams"
