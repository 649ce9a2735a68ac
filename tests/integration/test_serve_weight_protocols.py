"""SGLang's weight-update protocols between the trainer's client code
(``rollout.weights.transports``, the calls the RL loop makes) and ``megatron-earl serve``: a
server that receives weights W by ``tensor`` (portable payload, and SGLang's own payload format
with ``load_format`` None and "flattened_bucket"), ``disk`` (an HF directory from the streaming
exporter) or ``distributed`` (a gloo group, per-tensor and flattened buckets) then generates
exactly what a server started with W loaded directly generates, and reports the pushed version.
Bad pushes are refused before anything changes (wrong names, shapes, dtypes; the trainer's
pending broadcast fails at once), a group the trainer never joins times out with a clear error
while the server keeps generating, and a disk update outside ``--weight-dirs`` (symlinks
resolved) is answered 403 and loads nothing. A hostile pickle in place of an SGLang payload is
refused (400 naming the global) and runs nothing."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import pickle
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.convert.convert import export_hf
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.sglang.client import EngineRequestError, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.weights.sync import hf_named_tensors, serialize_named_tensors
from megatron_earl.rollout.weights.transports import build_transport
from megatron_earl.testing.distributed import free_port
from tests.integration.engine_calls import outputs, reported_version

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


def weights(seed: int, model: ModelConfig = MODEL) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.3 for k, s in global_shapes(model).items()}


W = weights(11)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("protocols")
    (tmp / "model.json").write_text(json.dumps(MODEL.to_dict()))
    torch.save(W, tmp / "w.pt")
    allowed = tmp / "allowed"
    allowed.mkdir()
    common = ("--model-config", str(tmp / "model.json"), "--max-seq-len", "64")
    ref = LaunchConfig(
        model_path=str(tmp / "w.pt"), port=free_port(), module="megatron_earl.rollout.serve.server",
        extra_args=common,
    )  # fmt: skip
    target = LaunchConfig(
        model_path="random", port=free_port(), module="megatron_earl.rollout.serve.server",
        weight_dirs=(str(allowed),), extra_args=(*common, "--seed", "3", "--dist-timeout", "4"),
    )  # fmt: skip
    procs = [
        ServerProcess(
            c, log_path=str(tmp / f"{n}.log"), env={"OMP_NUM_THREADS": "1"}, rebind_on_conflict=True
        )
        for n, c in (("ref", ref), ("target", target))
    ]
    try:
        for proc in procs:
            proc.wait_healthy(timeout_s=120)
        yield {"ref": procs[0].url, "target": procs[1].url, "tmp": tmp, "allowed": allowed}
    finally:
        stop_all(procs, stop_timeout_s=20)


async def _outputs(url: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return await outputs(url, PROMPT, GREEDY)


async def _push_with(transport, env, full, version: int, model=MODEL, close: bool = False):
    client = SGLangClient(env["target"])
    try:
        return await transport.push([client], hf_named_tensors(full, model), version)
    finally:
        if close:
            await transport.close([client])
        await client.close()


async def _push(env, settings: SGLangConfig, full, version: int, model: ModelConfig = MODEL):
    """One push by a transport of its own (closed after)."""
    transport = build_transport(settings, model, env["tmp"])
    return await _push_with(transport, env, full, version, model, close=True)


def _same_as_reference(env) -> bool:
    async def both():
        return await _outputs(env["ref"]), await _outputs(env["target"])

    (ref_ids, ref_lp), (ids, lp) = asyncio.run(both())
    if ids != ref_ids:
        return False
    assert lp == pytest.approx(ref_lp, abs=1e-6)
    return True


@pytest.mark.parametrize(
    "settings",
    [
        SGLangConfig(weight_update="tensor", bucket_bytes=64 << 10),
        SGLangConfig(weight_update="tensor", tensor_payload="sglang", bucket_bytes=64 << 10),
        SGLangConfig(
            weight_update="tensor",
            tensor_payload="sglang",
            tensor_load_format="flattened_bucket",
            bucket_bytes=64 << 10,
        ),
        SGLangConfig(weight_update="disk", weight_dir=None),
        SGLangConfig(weight_update="distributed", bucket_bytes=64 << 10, group_timeout_s=30),
        SGLangConfig(
            weight_update="distributed",
            distributed_load_format="flattened_bucket",
            bucket_bytes=64 << 10,
            group_timeout_s=30,
        ),
    ],
    ids=[
        "tensor",
        "tensor-sglang",
        "tensor-sglang-flattened",
        "disk",
        "distributed",
        "distributed-flattened",
    ],
)
def test_pushed_weights_serve_like_weights_loaded_directly(env, settings):
    if settings.weight_update == "disk":
        settings = dataclasses.replace(settings, weight_dir=str(env["allowed"] / "engine"))
    version = 100 + len(settings.weight_update) + 10 * len(settings.tensor_payload)
    transport = build_transport(settings, MODEL, env["tmp"])  # one per run, as the trainer's
    asyncio.run(_push_with(transport, env, weights(5), version - 1))  # other weights first
    assert not _same_as_reference(env)
    stats = asyncio.run(_push_with(transport, env, W, version, close=True))
    assert _same_as_reference(env)
    assert asyncio.run(reported_version(env["target"])) == version
    hf_bytes = sum(t.numel() * t.element_size() for _, t in hf_named_tensors(W, MODEL))
    assert stats.bytes_sent == hf_bytes
    if settings.weight_update != "disk":
        assert stats.num_buckets > 1
    else:  # only the newest version's directory is kept
        assert sorted(p.name for p in Path(settings.weight_dir).iterdir()) == [f"v{version}"]


def test_mismatched_pushes_are_refused_before_anything_changes(env):
    asyncio.run(_push(env, SGLangConfig(), W, 7))
    wider = dataclasses.replace(MODEL, ffn_hidden_size=96)
    bf16 = {k: t.bfloat16() for k, t in W.items()}
    distributed = SGLangConfig(weight_update="distributed", group_timeout_s=60)
    cases = [  # (settings, weights, model, what the error names)
        (distributed, weights(1, wider), wider, "has shape (96, 32), the model's is (64, 32)"),
        (distributed, bf16, MODEL, "has dtype bfloat16, the model's is float32"),
        (SGLangConfig(), bf16, MODEL, "has dtype bfloat16, the model's is float32"),
        (SGLangConfig(), weights(1, wider), wider, "has shape (96, 32)"),
    ]
    for settings, full, model, needle in cases:
        start = time.monotonic()
        with pytest.raises(EngineRequestError, match=r"refused|rejected") as info:
            asyncio.run(_push(env, settings, full, 8, model))
        assert needle in str(info.value) and "HTTP 400" in str(info.value)
        # the trainer's pending broadcast ended with the refusal, not at the group's timeout
        assert time.monotonic() - start < 30
        assert asyncio.run(reported_version(env["target"])) == 7
        assert _same_as_reference(env)

    async def raw_unknown_name() -> tuple[int, str]:
        body = {"names": ["model.layers.9.mlp.up_proj.weight"], "dtypes": ["float32"],
                "shapes": [[64, 32]], "group_name": "nope"}  # fmt: skip
        async with aiohttp.ClientSession() as s:
            async with s.post(env["target"] + "/update_weights_from_distributed", json=body) as r:
                return r.status, await r.text()

    status, text = asyncio.run(raw_unknown_name())
    assert status == 400 and "'nope' does not exist" in text


def test_group_the_trainer_never_joins_times_out_while_serving(env):
    async def body():
        client = SGLangClient(env["target"])
        port = free_port()  # nobody listens: the trainer never joins
        start = time.monotonic()
        init = asyncio.create_task(
            client.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
        )
        await asyncio.sleep(0.5)
        served = await client.generate(GenerateRequest(PROMPT, GREEDY))
        served_after = time.monotonic() - start
        with pytest.raises(EngineRequestError) as info:
            await init
        await client.close()
        return served, served_after, time.monotonic() - start, str(info.value)

    served, served_after, failed_after, message = asyncio.run(body())
    assert len(served.output_ids) == 12 and served_after < failed_after
    assert "not every rank joined within 4 s" in message and "HTTP 400" in message
    assert failed_after < 20


def test_disk_updates_only_inside_allowed_directories(env):
    tmp, allowed = env["tmp"], env["allowed"]
    asyncio.run(_push(env, SGLangConfig(), W, 20))
    export_hf(hf_named_tensors(weights(2), MODEL), MODEL, tmp / "outside")
    (allowed / "link").symlink_to(tmp / "outside", target_is_directory=True)
    torch.save(weights(2), tmp / "outside.pt")
    wider = dataclasses.replace(MODEL, ffn_hidden_size=96)
    export_hf(hf_named_tensors(weights(2, wider), wider), wider, allowed / "wider")

    async def post(path: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            body = {"model_path": path, "weight_version": "21"}
            async with s.post(env["target"] + "/update_weights_from_disk", json=body) as r:
                return r.status, await r.text()

    for path, status, needle in [
        (tmp / "outside", 403, "outside the directories allowed by --weight-dirs"),
        (allowed / "link", 403, "resolved"),
        (allowed / ".." / "outside", 403, "outside"),
        (tmp / "outside.pt", 403, "outside"),
        (allowed / "wider", 400, "down_proj.weight has shape (32, 96), the model's is (32, 64)"),
        (allowed / "missing", 400, "cannot load"),
    ]:
        got, text = asyncio.run(post(str(path)))
        assert got == status and needle in text, (path, got, text)
        assert asyncio.run(reported_version(env["target"])) == 20
        assert _same_as_reference(env)
    # The older form, a full Megatron state file, loads from an allowed directory.
    torch.save(weights(2), allowed / "other.pt")
    got, text = asyncio.run(post(str(allowed / "other.pt")))
    assert got == 200 and asyncio.run(reported_version(env["target"])) == 21
    assert not _same_as_reference(env)
    torch.save(W, allowed / "w.pt")
    assert asyncio.run(post(str(allowed / "w.pt")))[0] == 200
    assert _same_as_reference(env)


def test_disk_updates_are_off_without_weight_dirs(env):
    async def body():
        client = SGLangClient(env["ref"])
        try:
            await client.update_weights_from_disk(str(env["tmp"] / "w.pt"), weight_version=3)
        finally:
            await client.close()

    with pytest.raises(EngineRequestError, match=r"HTTP 403.*--weight-dirs"):
        asyncio.run(body())


class _Shell:
    """Unpickles as ``os.system(command)`` (what a hostile client would send)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def test_a_hostile_sglang_payload_is_refused_and_nothing_runs(env, tmp_path):
    asyncio.run(_push(env, SGLangConfig(tensor_payload="sglang"), W, 9))
    marker = tmp_path / "ran"
    hostile = [("lm_head.weight", _Shell(f"touch {marker}"))]
    payloads = [
        base64.b64encode(pickle.dumps(hostile)).decode(),
        base64.b64encode(pickle.dumps({"flattened_tensor": _Shell(f"touch {marker}")})).decode(),
    ]

    async def send(payload: str, load_format: str | None) -> tuple[int, str]:
        body = {"serialized_named_tensors": [payload], "load_format": load_format,
                "weight_version": "10"}  # fmt: skip
        async with aiohttp.ClientSession() as s:
            async with s.post(env["target"] + "/begin_weight_update", json={}) as r:
                assert r.status == 200, r.status
            try:
                async with s.post(env["target"] + "/update_weights_from_tensor", json=body) as r:
                    return r.status, await r.text()
            finally:
                async with s.post(env["target"] + "/end_weight_update", json={}) as r:
                    assert r.status == 200, r.status

    for payload, load_format in zip(payloads, (None, "flattened_bucket"), strict=True):
        status, text = asyncio.run(send(payload, load_format))
        assert status == 400 and "refers to posix.system" in text and "refused" in text, text
    assert not marker.exists()
    assert asyncio.run(reported_version(env["target"])) == 9
    assert _same_as_reference(env)


def test_disk_updates_read_no_file_outside_the_directory(env):
    """Shards an index names outside its directory (absolute, ``..``, a symlink), or a FIFO as
    the full-state file: 403, nothing read, and the answer says nothing about the outside
    path (a missing and an existing outside file get the same answer)."""
    import os

    tmp, allowed = env["tmp"], env["allowed"]
    asyncio.run(_push(env, SGLangConfig(), W, 30))
    export_hf(hf_named_tensors(weights(4), MODEL), MODEL, tmp / "outside4")
    shard = next((tmp / "outside4").glob("*.safetensors"))

    def hf_dir(name: str, file: str) -> Path:
        target = allowed / name
        export_hf(hf_named_tensors(weights(4), MODEL), MODEL, target)
        index = json.loads((target / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: file for n in index["weight_map"]}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
        return target

    linked = hf_dir("linked", "linked.safetensors")
    (linked / "linked.safetensors").symlink_to(shard)
    os.mkfifo(allowed / "fifo.pt")
    cases = [
        (hf_dir("absolute", str(shard)), "resolves outside"),
        (hf_dir("dotdot", f"../../{shard.parent.name}/{shard.name}"), "resolves outside"),
        (hf_dir("absent", "/nonexistent/x.safetensors"), "resolves outside"),
        (linked, "resolves outside"),
        (allowed / "fifo.pt", "not a directory or a regular file"),
    ]

    async def post(path: Path) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            body = {"model_path": str(path), "weight_version": "31"}
            async with s.post(env["target"] + "/update_weights_from_disk", json=body) as r:
                return r.status, (await r.json())["error"]["message"]

    answers = {}
    for path, needle in cases:
        status, message = asyncio.run(asyncio.wait_for(post(path), 30))
        assert status == 403 and needle in message, (path, status, message)
        answers[path.name] = message.replace(path.name, "")
        assert asyncio.run(reported_version(env["target"])) == 30
    assert answers["absolute"].replace(str(shard), "") == answers["absent"].replace(
        "/nonexistent/x.safetensors", ""
    )
    assert _same_as_reference(env)


def test_bad_group_init_and_versions_get_400_and_keep_a_working_group(env):
    """A bad init (port, world size, rank offset, NCCL on a CPU server) or a non-integral
    ``weight_version`` is a 400 before anything changes: a group of the same name keeps working."""
    settings = SGLangConfig(weight_update="distributed", bucket_bytes=64 << 10, group_timeout_s=30)
    transport = build_transport(settings, MODEL, env["tmp"])

    async def post(path: str, body: dict) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            async with s.post(env["target"] + path, json=body) as r:
                return r.status, await r.text()

    base = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    base["group_name"] = "weight_update_group"
    try:
        asyncio.run(_push_with(transport, env, weights(5), 40))
        for change, needle in [
            ({"master_port": 70000}, "master_port 70000 must be in [1, 65535]"),
            ({"master_port": -1}, "master_port -1 must be in [1, 65535]"),
            ({"master_port": 29500, "world_size": 1 << 40}, "world_size"),
            ({"master_port": 29500, "rank_offset": 0}, "rank_offset 0"),
            # a server computing on the CPU cannot join NCCL (one on CUDA can)
            ({"master_port": 29500, "backend": "nccl"}, "computes on cpu and joins with gloo"),
        ]:
            status, text = asyncio.run(post("/init_weights_update_group", base | change))
            assert status == 400 and needle in text, (change, status, text)
        payload = serialize_named_tensors([("model.norm.weight", torch.full((32,), 2.0))])
        assert asyncio.run(post("/begin_weight_update", {}))[0] == 200
        for version in (float("inf"), 2.5, True, "1e3"):
            body = {"serialized_named_tensors": [payload], "weight_version": version}
            status, text = asyncio.run(post("/update_weights_from_tensor", body))
            assert status == 400 and "weight_version" in text, (version, status, text)
        assert asyncio.run(post("/end_weight_update", {}))[0] == 200
        assert asyncio.run(reported_version(env["target"])) == 40
        asyncio.run(_push_with(transport, env, W, 41))  # the same group still works
        assert asyncio.run(reported_version(env["target"])) == 41
        assert _same_as_reference(env)
    finally:
        if transport.group is not None:
            asyncio.run(_push_with(transport, env, W, 42, close=True))


@pytest.mark.parametrize("kind", ["tensor", "distributed", "disk"])
def test_a_push_opens_the_weight_update_session_after_the_flush_and_closes_it_before_continuing(
    env, kind
):
    """SGLang 0.5.23's order: pause -> flush -> begin -> buckets -> end -> continue (disk: no
    session, SGLang's disk update needs none)."""
    settings = SGLangConfig(
        weight_update=kind, bucket_bytes=64 << 10, group_timeout_s=30,
        weight_dir=str(env["allowed"]),
    )  # fmt: skip
    transport = build_transport(settings, MODEL, env["tmp"])
    paths: list[str] = []

    async def push():
        client = SGLangClient(env["target"])
        client.on_request = lambda method, path, body: paths.append(path)
        try:
            await transport.push([client], hf_named_tensors(W, MODEL), 50)
        finally:
            await transport.close([client])
            await client.close()

    asyncio.run(push())
    update = {"tensor": "/update_weights_from_tensor", "disk": "/update_weights_from_disk",
              "distributed": "/update_weights_from_distributed"}[kind]  # fmt: skip
    # the run's start and end: the engines' TP size read once, the group joined and destroyed
    group = ("/get_server_info", "/init_weights_update_group", "/destroy_weights_update_group")
    calls = [p for i, p in enumerate(paths) if p not in group
             and not (i and p == update and paths[i - 1] == update)]  # fmt: skip
    begin, end = (["/begin_weight_update"], ["/end_weight_update"]) if kind != "disk" else ([], [])
    assert calls == [
        "/pause_generation", "/flush_cache", *begin, update, *end, "/continue_generation",
        "/get_model_info",
    ]  # fmt: skip
    assert kind == "disk" or paths.count(update) > 1  # several buckets in the one session
    assert asyncio.run(reported_version(env["target"])) == 50
    assert _same_as_reference(env)


def test_an_update_outside_a_session_is_refused_as_sglang_refuses_it_and_a_stale_session_is_closed(
    env,
):
    """serve keeps SGLang 0.5.23's session rules (its messages); a session a killed trainer left
    open is closed by the next push, which then lands."""
    payload = serialize_named_tensors([("model.norm.weight", torch.full((32,), 2.0))])

    async def post(path: str, body: dict) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            async with s.post(env["target"] + path, json=body) as r:
                return r.status, await r.text()

    status, text = asyncio.run(
        post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    )
    assert status == 400 and "update_weights_from_tensor must run between" in text, text
    status, text = asyncio.run(post("/end_weight_update", {}))
    assert status == 400 and "no weight-update session is open" in text, text
    assert asyncio.run(post("/begin_weight_update", {"selector": "nope"}))[0] == 400
    assert asyncio.run(post("/begin_weight_update", {}))[0] == 200  # then the trainer dies
    status, text = asyncio.run(post("/begin_weight_update", {}))
    assert status == 400 and "already open" in text, text
    asyncio.run(_push(env, SGLangConfig(bucket_bytes=64 << 10), W, 60))
    assert asyncio.run(reported_version(env["target"])) == 60
    assert _same_as_reference(env)
    status, text = asyncio.run(post("/end_weight_update", {}))
    assert status == 400 and "no weight-update session is open" in text, text  # closed by it
