"""Real SGLang against the trainer's client code: every weight-update protocol the trainer uses
(``rollout.weights.transports``, inside SGLang's weight-update session) delivers exactly the
pushed weights -- the engine's greedy tokens and log-probs are those of ``transformers`` on the
same weights exported as HF --, the weight-update group meets SGLang's own
``init_custom_process_group``, a group that never forms ends within its timeout on both sides
and leaves the engine serving, SGLang refuses updates outside a session, the start-up check reads
the real engine, and ``megatron-earl serve`` on the same HF model answers the same requests with
the same tokens and log-probs."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from megatron_earl.config.sampling import SamplingParams
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.convert.convert import export_hf
from megatron_earl.convert.engine_model import token_ids_config
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.rollout.engine import GenerateRequest, GenerateResult
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.identity import check_engines, read_identity
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.weights.group import broadcast_bucket, join_weight_update_group
from megatron_earl.rollout.weights.sync import hf_named_tensors, in_daemon_thread
from megatron_earl.rollout.weights.transports import build_transport
from megatron_earl.testing.distributed import free_port
from megatron_earl.tokenizer import build_tokenizer
from tests.sglang.conftest import KEY
from tests.tolerances import fp32_tol, gpt_terms

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
PROMPTS = ((2, 5, 17, 99, 3, 42, 7), (2, 9, 8, 7, 6))
PROTOCOLS = {
    "tensor-sglang": SGLangConfig(weight_update="tensor", tensor_payload="sglang"),
    "tensor-sglang-flattened": SGLangConfig(
        weight_update="tensor", tensor_payload="sglang", tensor_load_format="flattened_bucket"
    ),
    "distributed": SGLangConfig(weight_update="distributed", group_timeout_s=60),
    "distributed-flattened": SGLangConfig(
        weight_update="distributed", distributed_load_format="flattened_bucket", group_timeout_s=60
    ),
    "disk": SGLangConfig(weight_update="disk"),
}


def weights(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.3 for k, s in global_shapes(model).items()}


def client(url: str) -> SGLangClient:
    return SGLangClient(url, ClientConfig(api_key=KEY, max_retries=0))


async def generate_all(urls, prompts, params=GREEDY) -> list[list[GenerateResult]]:
    """Per engine, the results of ``prompts``."""
    out = []
    for url in urls:
        c = client(url)
        try:
            out.append([await c.generate(GenerateRequest(p, params)) for p in prompts])
        finally:
            await c.close()
    return out


@pytest.fixture(scope="module")
def hf_reference(run_config, tmp_path_factory):
    """seed -> (HF directory of ``weights(seed)``, transformers' model loaded from it)."""
    from transformers import AutoModelForCausalLM

    token_ids = token_ids_config(build_tokenizer(run_config.tokenizer))
    cache = {}

    def get(seed: int):
        if seed not in cache:
            out = tmp_path_factory.mktemp(f"hf{seed}") / "model"
            named = hf_named_tensors(weights(run_config.model, seed), run_config.model)
            export_hf(named, run_config.model, out, base_config=token_ids)
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            cache[seed] = (out, model)
        return cache[seed]

    return get


def check_like_transformers(hf_model, model_config, prompt, result: GenerateResult) -> None:
    """``result`` (greedy) is what transformers computes on the same weights: at every step the
    engine's token is transformers' argmax and its log-prob transformers' log-prob of it, both
    within the fp32 bound of two summation orders (``tests/tolerances.py``: a GPT forward over
    the sequence, magnitude the largest log-prob of the step). Checked token by token on the
    engine's own continuation, so a near-tie is judged within the bound, not by its ids."""
    ids = list(prompt) + list(result.output_ids)
    assert result.output_ids, "no token generated"
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tol_terms = gpt_terms(model_config, len(ids))
    for t, token in enumerate(result.output_ids):
        row = logprobs[len(prompt) - 1 + t]
        tol = fp32_tol(tol_terms, float(row.abs().max()))
        assert float(row[token]) >= float(row.max()) - tol, (t, token, int(row.argmax()))
        assert abs(result.output_logprobs[t] - float(row[token])) <= tol, (
            t, result.output_logprobs[t], float(row[token]), tol,
        )  # fmt: skip


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_push_serves_exactly_the_pushed_weights(
    engines, run_config, hf_reference, tmp_path, protocol
):
    """Pushed to both engines at once (the distributed group holds the trainer and both): each
    reports the version and generates what transformers generates on those weights."""
    seed = 10 + list(PROTOCOLS).index(protocol)
    model = run_config.model
    settings = PROTOCOLS[protocol]
    if settings.weight_update == "disk":
        settings = SGLangConfig(weight_update="disk", weight_dir=str(tmp_path / "weights"))
    transport = build_transport(settings, model, tmp_path)
    transport.hf_config = token_ids_config(build_tokenizer(run_config.tokenizer))
    urls = [e.url for e in engines]

    async def push():
        clients = [client(u) for u in urls]
        try:
            stats = await transport.push(
                clients, hf_named_tensors(weights(model, seed), model), seed
            )
            await transport.close(clients)
            return stats, [c.weight_version for c in clients]
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    stats, versions = asyncio.run(push())
    assert versions == [seed, seed] and stats.bytes_sent > 0
    _, hf_model = hf_reference(seed)
    for results in asyncio.run(generate_all(urls, PROMPTS)):
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result.weight_version == seed
            check_like_transformers(hf_model, model, prompt, result)


@pytest.fixture(scope="module")
def tp2_engine(python, engine_model, tmp_path_factory):
    """One real SGLang engine of TP 2 for the module (each test pushes its own weights first)."""
    from tests.sglang.conftest import start_engines

    engine = start_engines(python, engine_model, tmp_path_factory.mktemp("tp2"), 1, tp_size=2)[0]
    try:
        yield engine
    finally:
        stop_all([engine])


@pytest.mark.parametrize("protocol", ["tensor-sglang", "distributed"])
def test_a_push_to_a_tp2_engine_serves_exactly_the_pushed_weights(
    tp2_engine, run_config, hf_reference, tmp_path, protocol
):
    """An engine of TP 2: the trainer reads its TP size from it (``/get_server_info``), sends
    one SGLang payload per TP rank (tensor), or joins a group of 1 + 2 ranks (distributed); the
    engine then generates what transformers generates on the pushed weights."""
    seed, model, engine = 30 + (protocol == "distributed"), run_config.model, tp2_engine
    transport = build_transport(PROTOCOLS[protocol], model, tmp_path)

    async def push():
        c = client(engine.url)
        try:
            await transport.push([c], hf_named_tensors(weights(model, seed), model), seed)
            tp = await transport.engine_tp([c])
            await transport.close([c])
            return tp, c.weight_version
        finally:
            await c.close()

    assert asyncio.run(push()) == (2, seed)
    _, hf_model = hf_reference(seed)
    for prompt, result in zip(PROMPTS, asyncio.run(generate_all([engine.url], PROMPTS))[0]):
        check_like_transformers(hf_model, model, prompt, result)


@pytest.mark.parametrize("protocol", ["tensor-sglang", "distributed"])
def test_a_push_without_the_flush_before_it_leaves_no_prefix_of_the_old_weights(
    engines, run_config, hf_reference, tmp_path, protocol
):
    """The asynchronous loop and the relays push without flushing first (requests are in
    flight): the last bucket asks SGLang to flush once the new weights are in, so a prompt
    cached under the old weights is computed again under the new ones (without it SGLang reuses
    the cached prefix: log-probs off by ~1e-1 on these weights)."""
    import dataclasses

    model, url = run_config.model, engines[0].url
    old, new = 40 + 2 * (protocol == "distributed"), 41 + 2 * (protocol == "distributed")
    transport = build_transport(PROTOCOLS[protocol], model, tmp_path)

    async def push(seed: int) -> None:
        c = client(url)
        try:
            await transport.push([c], hf_named_tensors(weights(model, seed), model), seed)
        finally:
            await c.close()

    asyncio.run(push(old))
    asyncio.run(generate_all([url], PROMPTS))  # both prompts now cached under the old weights
    transport.sync = dataclasses.replace(transport.sync, flush_cache=False)
    asyncio.run(push(new))

    async def close():
        c = client(url)
        try:
            await transport.close([c])
        finally:
            await c.close()

    asyncio.run(close())
    _, hf_model = hf_reference(new)
    for prompt, result in zip(PROMPTS, asyncio.run(generate_all([url], PROMPTS))[0]):
        assert result.weight_version == new
        check_like_transformers(hf_model, model, prompt, result)


def test_sglang_refuses_updates_outside_a_session_and_a_second_session(engines):
    """What the trainer's session pair is for (``weights.sync.paused``): without it SGLang
    0.5.23 refuses the update; the client closes a session left open by a dead push."""
    url = engines[0].url
    headers = {"Authorization": f"Bearer {KEY}"}

    async def post(path: str, body: dict) -> tuple[int, str]:
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.post(url + path, json=body) as r:
                return r.status, await r.text()

    async def body():
        payload = base64.b64encode(b"never unpickled outside a session").decode()
        tensor = await post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        distributed = await post(
            "/update_weights_from_distributed",
            {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]},
        )
        assert (await post("/begin_weight_update", {}))[0] == 200  # then its pusher dies
        again = await post("/begin_weight_update", {})
        c = client(url)
        try:
            await c.begin_weight_update()  # closes the stale session, opens its own
            await c.end_weight_update()
        finally:
            await c.close()
        after = await post("/end_weight_update", {})
        return tensor, distributed, again, after

    tensor, distributed, again, after = asyncio.run(body())
    assert tensor[0] == 400 and "must run between begin_weight_update()" in tensor[1]
    assert distributed[0] == 400 and "must run between begin_weight_update()" in distributed[1]
    assert again[0] == 400 and "already open" in again[1]
    assert after[0] == 400 and "no weight-update session is open" in after[1]


SGLANG_RANK = """
import os, sys, torch, torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group
port, name = int(sys.argv[1]), sys.argv[2]
pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                               world_size=2, rank=1, group_name=name)
t = torch.empty(3)
dist.broadcast(t, src=0, group=pg)
print(t.tolist(), flush=True)
os._exit(0)  # gloo's threads may abort a normal interpreter exit ("terminate called ...")
"""
"""An engine TP rank joined by SGLang's own function (the real server calls it so)."""


def test_the_trainers_group_meets_sglangs_own_init_custom_process_group(python):
    port = free_port()
    peer = subprocess.Popen(
        [python, "-c", SGLANG_RANK, str(port), "megatron_earl_weights"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        group = join_weight_update_group(
            "127.0.0.1", port, 0, 2, "megatron_earl_weights", "gloo", 60
        )
        broadcast_bucket(group, [("a", torch.tensor([1.0, 2.0, 3.0]))])
        out, err = peer.communicate(timeout=120)
    finally:
        peer.kill()
    assert peer.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "[1.0, 2.0, 3.0]"


def test_a_group_that_never_forms_ends_within_its_timeout_and_the_engine_serves_on(engines):
    """The engine is told a world of 3 of which only it and the trainer exist: the trainer's join
    and the engine's HTTP answer end within the group's timeout (SGLang's own wait has none
    shorter than 30 min: it ends when the trainer drops the store it hosts), and the engine then
    generates."""
    url, timeout_s = engines[1].url, 5.0
    port = free_port()

    async def body():
        c = client(url)
        start = time.monotonic()
        try:
            local = in_daemon_thread(
                join_weight_update_group, "127.0.0.1", port, 0, 3, "never", "gloo", timeout_s
            )
            init = c.init_weights_update_group(
                "127.0.0.1", port, 1, 3, "never", "gloo", timeout_s=timeout_s
            )
            results = await asyncio.gather(local, init, return_exceptions=True)
            ended = time.monotonic() - start
            result = await asyncio.wait_for(c.generate(GenerateRequest((2, 5), GREEDY)), 60)
            return results, ended, result
        finally:
            await c.close()

    (local, init), ended, result = asyncio.run(body())
    assert isinstance(local, TimeoutError) and "not every rank joined within 5 s" in str(local)
    assert isinstance(init, Exception)
    assert ended < timeout_s + 30  # not SGLang's 30 min; the slack covers a busy machine
    assert len(result.output_ids) > 0


def test_the_start_up_check_reads_real_sglang(engines, run_config):
    async def identities():
        clients = [client(e.url) for e in engines]
        try:
            return await asyncio.gather(*(read_identity(c) for c in clients))
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    found = asyncio.run(identities())
    for identity in found:
        assert not identity.is_serve and identity.version == "0.5.23"
        assert identity.tp_size == 1 and identity.device == "cpu"
        assert identity.architectures == ("LlamaForCausalLM",)
        assert identity.hf_config["vocab_size"] == run_config.model.vocab_size
    model = run_config.model
    ok = check_engines(found, SGLangConfig(weight_update="distributed"), model)
    assert ok.problems == [] and ok.warnings == [] and ok.engine_tp == 1
    portable = check_engines(found, SGLangConfig(weight_update="tensor"), model).problems
    assert len(portable) == 2 and "cannot read tensor_payload 'portable'" in portable[0]
    import dataclasses

    wider = dataclasses.replace(model, vocab_size=model.vocab_size + 64)
    other = check_engines(found, SGLangConfig(weight_update="distributed"), wider).problems
    assert (
        "serves another model: vocab_size=320, the trainer's model has vocab_size=384" in (other[0])
    )
    tp2 = check_engines(found, SGLangConfig(weight_update="distributed", engine_tp=2), model)
    assert "runs with tp_size=1, rollout.sglang.engine_tp is 2" in tp2.problems[0]


@pytest.fixture(scope="module")
def serve_on_the_engine_model(engine_model, tmp_path_factory):
    """``megatron-earl serve`` on the HF directory the SGLang engines started from."""
    launch = LaunchConfig(
        model_path=str(engine_model),
        port=free_port(),
        module="megatron_earl.rollout.serve.server",
        api_key=KEY,
        extra_args=("--max-seq-len", "256"),
    )
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = ServerProcess(
        launch, log_path=str(log), env={"OMP_NUM_THREADS": "1"}, rebind_on_conflict=True
    )
    try:
        proc.wait_healthy(timeout_s=180)
        yield proc
    finally:
        stop_all([proc])


def test_serve_and_sglang_answer_alike_on_the_same_hf_model(
    python, engine_model, run_config, serve_on_the_engine_model, tmp_path
):
    """A fresh SGLang engine (the tier's others hold pushed weights) and serve, both on the
    engine model: greedy tokens and their log-probs agree within the fp32 bound
    (``check_like_transformers`` against transformers on the same directory), prompt log-probs
    from ``logprob_start_len`` and the top log-probs have SGLang's shapes on both, and every
    sampling field the trainer sends is accepted by both."""
    from transformers import AutoModelForCausalLM

    from tests.sglang.conftest import start_engines

    fresh = start_engines(python, engine_model, tmp_path, 1)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(engine_model, dtype=torch.float32).eval()
        urls = [fresh[0].url, serve_on_the_engine_model.url]
        for results in asyncio.run(generate_all(urls, PROMPTS)):
            for prompt, result in zip(PROMPTS, results, strict=True):
                check_like_transformers(hf_model, run_config.model, prompt, result)

        async def shapes(url: str) -> dict:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
                body = {
                    "input_ids": list(PROMPTS[0]),
                    "sampling_params": {
                        "max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                        "min_p": 0.01, "stop_token_ids": [3], "stop": ["\n"],
                        "sampling_seed": 7, "ignore_eos": True, "n": 1,
                    },
                    "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
                }  # fmt: skip
                async with s.post(url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    meta = (await r.json())["meta_info"]
            return {
                "input": len(meta["input_token_logprobs"]),
                "input_top": [len(x or []) for x in meta["input_top_logprobs"][1:]],
                "output": len(meta["output_token_logprobs"]),
                "output_top": [len(x) for x in meta["output_top_logprobs"]],
                "finish": meta["finish_reason"]["type"],
            }

        sglang, serve = (asyncio.run(shapes(u)) for u in urls)
        assert sglang["input"] == serve["input"] == len(PROMPTS[0]) - 2
        assert sglang["input_top"] == serve["input_top"] == [3] * (len(PROMPTS[0]) - 3)
        assert sglang["output"] == len(sglang["output_top"]) and set(sglang["output_top"]) == {3}
        assert serve["output"] == len(serve["output_top"]) and set(serve["output_top"]) == {3}
        assert sglang["finish"] in ("length", "stop") and serve["finish"] in ("length", "stop")
    finally:
        stop_all(fresh)


def test_engine_model_carries_the_tokenizers_end_of_sequence_ids(engine_model, run_config):
    config = json.loads((Path(engine_model) / "config.json").read_text())
    tokenizer = build_tokenizer(run_config.tokenizer)
    assert config["eos_token_id"] == list(tokenizer.stop_ids)
    assert config["pad_token_id"] == tokenizer.pad_id
