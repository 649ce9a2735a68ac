"""Contract tests against the pinned SGLang release's request schema, both directions.

* Our client -> SGLang: every request body the SGLang client sends fits SGLang's own request
  classes (only fields the class declares, every field without a default given). The client
  talks to a small in-process recorder (the real server is exercised in
  tests/integration/test_serve.py).
* SGLang -> ``serve``: ``/generate`` accepts exactly the fields of SGLang's ``GenerateReqInput``
  and ``SamplingParams`` (and of its HTTP contract ``sglang/api/v1/api_types.py``), and a body
  giving every one of them at its SGLang default parses (no 400). What the RL fields do is
  checked against the model in tests/distributed/test_serve_schema.py.

The schema comes from ``tests/fixtures/sglang_schema_<SGLANG_PINNED>.json``, written by
``scripts/sglang_schema.py`` from the wheel's sources (``ast``, never imported), so these tests
run without the wheel; when the wheel is cached (``$MEGATRON_EARL_CACHE`` or
``~/.cache/megatron_earl``) the fixture is also checked against a fresh parse.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
import json
import zipfile
from pathlib import Path

import pytest
import torch
from aiohttp import web

from megatron_earl.config.sampling import SamplingParams
from megatron_earl.config.vocab import MEMORY_TAGS
from megatron_earl.rollout.embedded.memory_occupation import MEMORY_FIELDS
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.serve.generate_api import (
    GENERATE_FIELDS,
    GENERATE_IGNORED,
    GENERATE_IMPLEMENTED,
    GENERATE_NEUTRAL,
    ROUTER_ADDED,
    SAMPLING_FIELDS,
    SAMPLING_IGNORED,
    SAMPLING_IMPLEMENTED,
    SAMPLING_NEUTRAL,
    parse_generate,
)
from megatron_earl.rollout.serve.weights import GET_WEIGHTS_FIELDS
from megatron_earl.rollout.sglang.client import SGLANG_PINNED, ClientConfig, SGLangClient
from megatron_earl.rollout.weights.sync import serialize_named_tensors

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sglang_schema", REPO / "scripts/sglang_schema.py")
sglang_schema = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sglang_schema)

# Endpoint -> request class in io_struct.py (None: no body is sent).
ENDPOINTS = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/flush_cache": None,
    "/health": None,
    "/get_model_info": None,
    "/get_server_info": None,
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
}


def load_schema() -> dict[str, dict[str, dict]]:
    """{"<source>.<class>": {field: {"has_default", "default"...}}} of the pinned release."""
    path = sglang_schema.fixture_path(SGLANG_PINNED)
    assert path.exists(), f"{path} is missing; run python scripts/sglang_schema.py"
    data = json.loads(path.read_text())
    assert data["sglang_version"] == SGLANG_PINNED
    return data["classes"]


@pytest.fixture(scope="module")
def schema() -> dict[str, dict[str, dict]]:
    return load_schema()


def test_fixture_equals_a_fresh_parse_of_the_wheel():
    """The wheel is downloaded once into the cache (~39 MB, PyPI); only when PyPI cannot be
    reached is this skipped -- the contract tests below use the committed fixture either way."""
    wheel = sglang_schema.find_wheel(SGLANG_PINNED, download=True)
    if wheel is None:
        pytest.skip(
            f"sglang=={SGLANG_PINNED} cannot be downloaded into {sglang_schema.cache_dir()} "
            "(no network?); the contract tests use the committed fixture"
        )
    fresh = sglang_schema.dumps(sglang_schema.parse_schema(sglang_schema.read_sources(wheel)))
    assert sglang_schema.fixture_path().read_text() == fresh, (
        "the fixture differs from the wheel: python scripts/sglang_schema.py"
    )


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
        if request.path == "/get_weights_by_name":
            return web.json_response([[0.5, 0.25]])
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
    await client.begin_weight_update()
    await client.update_weights_from_tensor(
        [serialize_named_tensors([("lm_head.weight", torch.zeros(2, 2))])], weight_version=4
    )
    await client.init_weights_update_group("127.0.0.1", 1234, 1, 2, backend="gloo")
    await client.update_weights_from_distributed(["w"], ["float32"], [[2, 2]], weight_version=5)
    await client.end_weight_update()
    await client.destroy_weights_update_group()
    await client.update_weights_from_disk("/ckpt", weight_version=6)
    await client.release_memory_occupation()
    await client.resume_memory_occupation(["weights"])
    await client.resume()
    await client.health()
    await client.get_model_info()
    await client.get_server_info()
    assert await client.get_weights_by_name("lm_head.weight", 1) == [[0.5, 0.25]]
    await client.close()
    await runner.cleanup()
    return sent


def test_client_requests_match_sglang_io_struct(schema):
    sampling_fields = schema["sampling.SamplingParams"]
    sent = asyncio.run(_record_client_requests())
    assert {path for _, path, _ in sent} == set(ENDPOINTS), "every endpoint must be exercised"
    for method, path, body in sent:
        cls = ENDPOINTS[path]
        if cls is None:
            assert body is None, f"{method} {path} sends no body in SGLang, got {body}"
            continue
        fields = schema[f"io_struct.{cls}"]
        unknown = set(body) - set(fields)
        assert not unknown, f"{path}: fields {sorted(unknown)} are not in sglang {cls}"
        missing = {f for f, info in fields.items() if not info["has_default"]} - set(body)
        assert not missing, f"{path}: required fields {sorted(missing)} of {cls} not sent"
        if path == "/generate":
            extra = set(body["sampling_params"]) - set(sampling_fields)
            assert not extra, f"sampling_params {sorted(extra)} not in sglang SamplingParams"
            extra = set(body["sampling_params"]) - set(schema["api.SamplingParams"])
            assert not extra, f"sampling_params {sorted(extra)} rejected by sglang's HTTP contract"


def _sglang_fields(schema, dataclass: str, api: str) -> dict[str, dict]:
    """Fields of the dataclass and of the HTTP contract class (the dataclass's info first)."""
    return {**schema[api], **schema[dataclass]}


def _default(info: dict, api_info: dict | None):
    """SGLang's default value of a field (the HTTP contract's when the dataclass's is not a
    literal, e.g. ``top_k = TOP_K_ALL``)."""
    if "default_source" in info and api_info is not None:
        return api_info.get("default")
    return info.get("default")


def test_serve_accepts_exactly_sglangs_generate_fields(schema):
    gen = _sglang_fields(schema, "io_struct.GenerateReqInput", "api.GenerateRequest")
    samp = _sglang_fields(schema, "sampling.SamplingParams", "api.SamplingParams")
    ours = GENERATE_FIELDS - set(ROUTER_ADDED)  # what the router adds is not SGLang's schema
    assert not set(ROUTER_ADDED) & set(gen)
    assert set(ours) == set(gen), (
        f"serve lacks {sorted(set(gen) - ours)}, has extra {sorted(ours - set(gen))}"
    )
    assert set(SAMPLING_FIELDS) == set(samp), (
        f"serve lacks {sorted(set(samp) - SAMPLING_FIELDS)}, "
        f"has extra {sorted(SAMPLING_FIELDS - set(samp))}"
    )
    # each field in exactly one category
    for parts in (
        (GENERATE_IMPLEMENTED, set(GENERATE_IGNORED), set(GENERATE_NEUTRAL)),
        (SAMPLING_IMPLEMENTED, set(SAMPLING_IGNORED), set(SAMPLING_NEUTRAL)),
    ):
        assert sum(map(len, parts)) == len(set().union(*parts))


def neutral_body(schema) -> dict:
    """A /generate body giving every field of SGLang's schema at SGLang's default."""
    gen_api, samp_api = schema["api.GenerateRequest"], schema["api.SamplingParams"]
    gen = _sglang_fields(schema, "io_struct.GenerateReqInput", "api.GenerateRequest")
    samp = _sglang_fields(schema, "sampling.SamplingParams", "api.SamplingParams")
    body = {name: _default(info, gen_api.get(name)) for name, info in gen.items()}
    sampling = {name: _default(info, samp_api.get(name)) for name, info in samp.items()}
    body.update(input_ids=[1, 2, 3], sampling_params=sampling)
    return body


def test_every_sglang_field_at_its_default_is_accepted(schema):
    body = neutral_body(schema)
    plan = parse_generate(body, max_seq_len=1024)
    plain = parse_generate({"input_ids": [1, 2, 3]}, max_seq_len=1024)
    (request,), (expected,) = plan.requests, plain.requests
    assert request.sampling.top_k == 1 << 30  # SGLang's TOP_K_ALL: the whole vocabulary
    sampling = dataclasses.replace(request.sampling, top_k=-1)
    assert dataclasses.replace(request, sampling=sampling) == expected
    assert plan.options == plain.options and not plan.batched and not plan.stream


def test_serve_memory_endpoints_take_sglangs_fields(schema):
    for cls in ("ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"):
        assert set(schema[f"io_struct.{cls}"]) == MEMORY_FIELDS, cls
        assert schema[f"io_struct.{cls}"]["tags"] == {"has_default": True, "default": None}


def test_serve_get_weights_by_name_takes_sglangs_fields(schema):
    fields = schema["io_struct.GetWeightsByNameReqInput"]
    assert set(fields) == GET_WEIGHTS_FIELDS
    assert fields["truncate_size"] == {"has_default": True, "default": 100}


def test_memory_tags_are_sglangs():
    wheel = sglang_schema.find_wheel(SGLANG_PINNED, download=True)
    if wheel is None:
        pytest.skip(f"sglang=={SGLANG_PINNED} cannot be downloaded (no network?)")
    with zipfile.ZipFile(wheel) as zf:
        tree = ast.parse(zf.read("sglang/srt/constants.py").decode())
    consts = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    names = [elt.id for elt in consts["GPU_MEMORY_ALL_TYPES"].elts]
    assert [ast.literal_eval(consts[n]) for n in names] == list(MEMORY_TAGS)


def test_serve_info_answers_carry_sglangs_fields(schema):
    """``/get_model_info``, ``/get_server_info`` and ``/v1/models`` of ``serve`` carry every
    field SGLang's answer has (``http_server.py``'s ``model_info`` keys, ``api_types.py``'s
    response types, the OpenAI ``ModelList`` / ``ModelCard`` exactly), with SGLang's types."""
    from megatron_earl.rollout.serve.model import (
        model_info_json,
        models_json,
        resolve_model,
        server_args_json,
        server_info_json,
    )
    from megatron_earl.rollout.serve.server import parse_args

    responses = json.loads(sglang_schema.fixture_path(SGLANG_PINNED).read_text())["responses"]
    served = resolve_model("random")
    info = model_info_json(served, 3)
    assert set(responses["http_server.model_info"]) <= set(info)
    assert set(schema["api.GetModelInfoResponse"]) <= set(info)
    assert info["weight_version"] == "3" and info["is_generation"] is True
    args = parse_args(["--max-seq-len", "64"])
    server = server_info_json(
        server_args_json(args, served), served, max_batch_size=8, max_seq_len=64, paused=False
    )
    assert set(schema["api.GetServerInfoResponse"]) <= set(server)
    assert isinstance(server["internal_states"], list) and server["port"] == args.port
    assert server["max_total_num_tokens"] == 8 * 64 and server["max_context_length"] == 64
    assert not any("key" in k for k in server), "server info must not carry API keys"
    models = models_json(served, 64)
    assert set(models) == set(schema["openai.ModelList"]) and models["object"] == "list"
    (card,) = models["data"]
    assert set(card) == set(schema["openai.ModelCard"])
    assert set(schema["api.ModelCard"]) <= set(card) and card["max_model_len"] == 64
