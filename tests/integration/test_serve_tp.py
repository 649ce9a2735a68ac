"""``megatron-earl serve --tp-size 2`` (one model over two processes) against ``--tp-size 1`` on
the same weights, started by the SGLang launcher's code path: the same greedy tokens and
log-probs (within 1e-4) from a full-state file, and again after each weight-update protocol
(tensor with two payloads, disk, distributed with every TP rank in the trainer's group as
``rank_offset + tp_rank``: ``rollout.sglang.engine_tp=2``), after which ``get_weights_by_name``
reads the pushed values back from both; requests shaped for another TP size
get a 400 naming it. Lifetime: SIGTERM to the process group stops rank 0 and its follower
cleanly (exit 0); SIGKILL of rank 0 alone leaves no follower; a follower killed ends the
server (exit 1)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import psutil
import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sampling import SamplingParams
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.rollout.engine import GenerateRequest
from megatron_earl.rollout.serve.tp import PARENT_ENV
from megatron_earl.rollout.sglang.client import SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.weights.sync import hf_named_tensors, serialize_named_tensors
from megatron_earl.rollout.weights.transports import build_transport
from megatron_earl.testing.distributed import free_port

LOGPROB_TOL = 1e-4
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    make_vocab_size_divisible_by=64,
    add_qkv_bias=True,
    init_method_std=0.1,
)
PROMPTS = ((5, 17, 99, 3, 42, 7), (200, 1, 2), tuple(range(30, 52)))
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
ENV = {"OMP_NUM_THREADS": "1"}


def _launch(
    tmp, tp: int, *extra: str, model_path: str = "random", weight_dirs: tuple[str, ...] = ()
) -> LaunchConfig:
    return LaunchConfig(
        model_path=model_path,
        port=free_port(),
        tp_size=tp,
        module="megatron_earl.rollout.serve.server",
        weight_dirs=weight_dirs,
        extra_args=(
            "--model-config",
            str(tmp / "model.json"),
            "--seed",
            "3",
            "--max-seq-len",
            "64",
            *extra,
        ),
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_tp")
    (tmp / "model.json").write_text(json.dumps(MODEL.to_dict()))
    allowed = tmp / "allowed"
    allowed.mkdir()
    torch.save(weights(1), tmp / "w.pt")  # a seeded TP2 build alone would equal TP1 already
    procs = {
        tp: ServerProcess(
            _launch(
                tmp,
                tp,
                "--dist-timeout",
                "30",
                model_path=str(tmp / "w.pt"),
                weight_dirs=(str(allowed),),
            ),
            log_path=str(tmp / f"tp{tp}.log"),
            env=ENV,
            rebind_on_conflict=True,
        )
        for tp in (1, 2)
    }
    try:
        for proc in procs.values():
            proc.wait_healthy(timeout_s=240)
        yield {"procs": procs, "tmp": tmp, "allowed": allowed}
    finally:
        stop_all(list(procs.values()), stop_timeout_s=30)


def _followers(proc: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(proc.process.pid).children()


async def _outputs(url: str) -> list[tuple[tuple[int, ...], tuple[float, ...], int]]:
    client = SGLangClient(url)
    try:
        results = [await client.generate(GenerateRequest(p, GREEDY)) for p in PROMPTS]
    finally:
        await client.close()
    return [(r.output_ids, r.output_logprobs, r.weight_version) for r in results]


def _assert_same(servers) -> list:
    async def both():
        return [await _outputs(servers["procs"][tp].url) for tp in (1, 2)]

    tp1, tp2 = asyncio.run(both())
    for (ids1, lp1, v1), (ids2, lp2, v2) in zip(tp1, tp2, strict=True):
        assert ids2 == ids1 and v2 == v1
        assert torch.allclose(torch.tensor(lp2), torch.tensor(lp1), atol=LOGPROB_TOL, rtol=0)
    return tp2


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.3 for k, s in global_shapes(MODEL).items()}


def test_tp2_serves_like_tp1(servers):
    assert len(_followers(servers["procs"][2])) == 1
    assert _followers(servers["procs"][1]) == []
    outputs = _assert_same(servers)
    assert len({ids for ids, _, _ in outputs}) == len(PROMPTS)  # not a degenerate model


@pytest.mark.parametrize("protocol", ["tensor", "disk", "distributed"])
def test_weight_updates_keep_tp2_equal_to_tp1(servers, protocol):
    before = _assert_same(servers)
    version = 10 + len(protocol)

    async def push(tp: int) -> None:
        settings = SGLangConfig(
            weight_update=protocol,
            engine_tp=tp,
            bucket_bytes=32 << 10,
            group_timeout_s=30,
            weight_dir=str(servers["allowed"] / f"tp{tp}") if protocol == "disk" else None,
        )
        transport = build_transport(settings, MODEL, servers["tmp"])
        client = SGLangClient(servers["procs"][tp].url)
        try:
            full = weights(version)
            await transport.push([client], hf_named_tensors(full, MODEL), version)
        finally:
            await transport.close([client])
            await client.close()

    for tp in (1, 2):
        asyncio.run(push(tp))
    after = _assert_same(servers)
    assert [ids for ids, _, _ in after] != [ids for ids, _, _ in before]
    assert {v for _, _, v in after} == {version}
    pushed = dict(hf_named_tensors(weights(version), MODEL))
    name = "model.layers.1.self_attn.k_proj.weight"  # rows split over the TP ranks

    async def read(tp: int) -> list:
        client = SGLangClient(servers["procs"][tp].url)
        try:
            return await client.get_weights_by_name(name, 100)
        finally:
            await client.close()

    for tp in (1, 2):  # gathered from both ranks, as loaded
        assert asyncio.run(read(tp)) == pushed[name][:100].tolist()


def test_requests_shaped_for_another_tp_size_are_refused(servers):
    url = servers["procs"][2].url
    payload = serialize_named_tensors([("model.norm.weight", torch.ones(MODEL.hidden_size))])
    other = serialize_named_tensors([("model.norm.weight", torch.zeros(MODEL.hidden_size))])

    async def post(path: str, body: dict) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, json=body) as resp:
                return resp.status, (await resp.json())["error"]["message"]

    async def post_ok(path: str, body: dict) -> int:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, json=body) as resp:
                return resp.status

    async def body():
        assert (await post_ok("/begin_weight_update", {})) == 200
        one = await post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        two = await post(
            "/update_weights_from_tensor", {"serialized_named_tensors": [payload, other]}
        )
        assert (await post_ok("/end_weight_update", {})) == 200
        group = await post(
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": free_port(),
                "rank_offset": 1,
                "world_size": 2,
                "backend": "gloo",
            },
        )
        return one, two, group

    one, two, group = asyncio.run(body())
    assert one[0] == 400 and "list of 2 payload(s)" in one[1]
    assert two[0] == 400 and "must be identical" in two[1]
    assert group[0] == 400 and "world_size - tp = 0" in group[1]
    _assert_same(servers)  # nothing changed, both still serve


def _followers_of(pid: int) -> list[psutil.Process]:
    """Live followers of rank 0 ``pid`` (found by their environment, parent alive or not)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(PARENT_ENV) == str(pid):
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def _gone(procs: list[psutil.Process], timeout_s: float = 20.0) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return not alive


def test_followers_end_with_rank0_and_rank0_with_a_follower(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps(MODEL.to_dict()))
    procs = [
        ServerProcess(
            _launch(tmp_path, 2),
            log_path=str(tmp_path / f"s{i}.log"),
            env=ENV,
            rebind_on_conflict=True,
        )
        for i in range(3)
    ]
    # 4 heads do not split 3 ways: every rank exits with the model's error, none is left.
    bad = ServerProcess(_launch(tmp_path, 3), log_path=str(tmp_path / "bad.log"), env=ENV)
    try:
        # the error carries the end of the server's log, where its reason is
        with pytest.raises(
            RuntimeError, match=r"(?s)exited with code.*bad\.log.*heads \(4\) % tp \(3\)"
        ):
            bad.wait_healthy(timeout_s=240)
        assert _gone(_followers_of(bad.process.pid), 5.0)
        for proc in procs:
            proc.wait_healthy(timeout_s=240)
        followers = [_followers(p) for p in procs]
        assert [len(f) for f in followers] == [1, 1, 1]
        # SIGTERM to the process group (the launcher's stop): rank 0 stops its follower.
        assert procs[0].stop(stop_timeout_s=30) == 0
        assert _gone(followers[0], 10.0)  # reaped by then (slack for a loaded machine)
        # SIGKILL of rank 0 alone: the follower dies with it.
        assert [f.pid for f in _followers_of(procs[1].process.pid)] == [followers[1][0].pid]
        os.kill(procs[1].process.pid, signal.SIGKILL)
        procs[1].process.wait()
        assert _gone(followers[1])
        assert _followers_of(procs[1].process.pid) == []
        # A follower killed: rank 0 ends the server.
        followers[2][0].kill()
        start = time.monotonic()
        assert procs[2].process.wait(timeout=20) == 1
        assert time.monotonic() - start < 20
    finally:
        for proc in [*procs, bad]:
            proc.kill()
    assert "TP rank 1" in (tmp_path / "s2.log").read_text()
