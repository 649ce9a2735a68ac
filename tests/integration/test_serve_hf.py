"""``megatron-earl serve`` launched as SGLang is: ``--model-path`` an HF directory written by the
exporter (``convert.export_hf``, plus the demo tokenizer saved as an HF tokenizer) generates the
same greedy tokens as a server started from the same weights as a full-state file; ``text`` in
and out goes through the directory's tokenizer (the same ids as tokenizing on the client, stop
strings matched on its decoded text, the model's eos id from ``generation_config.json`` ends
generation unless ``ignore_eos``); ``/get_model_info``, ``/get_server_info``, ``/v1/models`` and
``/health_generate`` answer with SGLang's fields; a directory that cannot be served fails at
start-up naming the reason. A Llama-3-scaled tiny HF model (``rope_type: llama3``, tied as Llama
3.2 1B/3B) serves ``transformers``' greedy tokens for a prompt longer than its original context."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert.convert import export_hf
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.weights.sync import hf_named_tensors
from megatron_earl.testing.distributed import free_port
from megatron_earl.tokenizer.demo_hf import demo_hf_tokenizer

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=320,
    make_vocab_size_divisible_by=64,
)
PROMPT_TEXT = "<|im_start|>user\n3+4*2<|im_end|>\n<|im_start|>assistant\n"
NEW = 16


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.3 for k, s in global_shapes(MODEL).items()}


def _start(tmp, name: str, model_path: str, *extra: str) -> ServerProcess:
    launch = LaunchConfig(
        model_path=model_path,
        port=free_port(),
        module="megatron_earl.rollout.serve.server",
        extra_args=("--max-seq-len", "64", *extra),
    )
    return ServerProcess(
        launch, log_path=str(tmp / f"{name}.log"), env={"OMP_NUM_THREADS": "1"},
        rebind_on_conflict=True,
    )  # fmt: skip


async def _post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _get(url: str, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url + path) as resp:
        return resp.status, await resp.json()


def _greedy(url: str, ids: list[int], **sampling) -> dict:
    params = {"max_new_tokens": NEW, "temperature": 0.0, **sampling}
    return asyncio.run(_post(url, "/generate", {"input_ids": ids, "sampling_params": params}))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A reference server from a full-state file; its greedy output picks the eos id written
    into the HF directory's generation_config.json (a token it generates mid-way), then the HF
    server starts from the exported directory."""
    tmp = tmp_path_factory.mktemp("serve_hf")
    weights = _weights(1)  # a seed whose greedy output varies (many give one repeated token)
    torch.save(weights, tmp / "w.pt")
    (tmp / "model.json").write_text(json.dumps(MODEL.to_dict()))
    tok = demo_hf_tokenizer()
    prompt = tok.encode(PROMPT_TEXT)
    ref = _start(tmp, "ref", str(tmp / "w.pt"), "--model-config", str(tmp / "model.json"))
    procs = [ref]
    try:
        ref.wait_healthy(timeout_s=120)
        ref_ids = _greedy(ref.url, prompt)["output_ids"]
        # the eos: the last generated token that does not occur earlier (and is not the
        # tokenizer's own eos, 3, on which the two servers would disagree)
        k = max(i for i in range(NEW) if ref_ids[i] not in ref_ids[:i] and ref_ids[i] != 3)
        hf_dir = tmp / "hf"
        export_hf(hf_named_tensors(weights, MODEL), MODEL, hf_dir)
        tok.save_pretrained(hf_dir)
        (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ref_ids[k]}))
        hf = _start(tmp, "hf", str(hf_dir), "--served-model-name", "tiny")
        procs.append(hf)
        hf.wait_healthy(timeout_s=120)
        yield {
            "ref": ref.url,
            "hf": hf.url,
            "hf_dir": hf_dir,
            "tok": tok,
            "prompt": prompt,
            "ref_ids": ref_ids,
            "eos_at": k,
            "tmp": tmp,
        }
    finally:
        stop_all(procs, stop_timeout_s=20)


def test_hf_directory_generates_what_the_full_state_file_generates(env):
    got = _greedy(env["hf"], env["prompt"], ignore_eos=True)
    ref = _greedy(env["ref"], env["prompt"], ignore_eos=True)
    assert got["output_ids"] == ref["output_ids"] == env["ref_ids"]


def test_the_models_eos_ends_generation_unless_ignore_eos(env):
    k, ids = env["eos_at"], env["ref_ids"]
    got = _greedy(env["hf"], env["prompt"])
    assert got["output_ids"] == ids[: k + 1]
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert _greedy(env["ref"], env["prompt"])["output_ids"] == ids  # no eos without HF


def test_text_goes_through_the_tokenizer(env):
    tok = env["tok"]
    params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    body = {"text": PROMPT_TEXT, "sampling_params": params}
    out = asyncio.run(_post(env["hf"], "/generate", body))
    assert out["meta_info"]["prompt_tokens"] == len(env["prompt"])
    assert out["output_ids"] == env["ref_ids"]
    assert out["text"] == tok.decode(env["ref_ids"], skip_special_tokens=True)
    # a stop string: the decoded text of a generated token, cut where it first appears
    ids = env["ref_ids"]
    texts = [tok.decode([t], skip_special_tokens=True) for t in ids]
    j = next(
        i
        for i in range(2, NEW)
        if texts[i].isascii()
        and texts[i].strip()
        and texts[i] not in tok.decode(ids[:i], skip_special_tokens=True)
    )
    body["sampling_params"] = {**params, "stop": [texts[j]]}
    out = asyncio.run(_post(env["hf"], "/generate", body))
    assert out["output_ids"] == ids[: j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": texts[j]}
    assert out["text"] == tok.decode(ids[:j], skip_special_tokens=True)


def test_info_endpoints_answer_as_sglang(env):
    status, info = asyncio.run(_get(env["hf"], "/get_model_info"))
    assert status == 200
    assert info["model_path"] == str(env["hf_dir"])
    assert info["tokenizer_path"] == str(env["hf_dir"])
    assert info["served_model_name"] == "tiny"
    assert info["is_generation"] is True and info["weight_version"] == "0"
    assert (info["model_type"], info["architectures"]) == ("llama", ["LlamaForCausalLM"])
    _, ref_info = asyncio.run(_get(env["ref"], "/get_model_info"))
    assert ref_info["tokenizer_path"] is None and ref_info["tokenizer"] == "byte-level stand-in"
    assert ref_info["served_model_name"] == ref_info["model_path"]

    status, server = asyncio.run(_get(env["hf"], "/get_server_info"))
    assert status == 200
    assert server["max_total_num_tokens"] == 8 * 64 and server["max_req_input_len"] == 63
    assert server["context_length"] == server["max_context_length"] == 64
    assert len(server["internal_states"]) == 1 and server["internal_states"][0]["tp_size"] == 1
    assert server["version"] == "0.5.23" and server["tokenizer_path"] == str(env["hf_dir"])
    assert "api_key" not in server

    status, models = asyncio.run(_get(env["hf"], "/v1/models"))
    assert status == 200 and models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["root"], card["object"], card["max_model_len"]) == (
        "tiny",
        "tiny",
        "model",
        64,
    )
    assert asyncio.run(_get(env["hf"], "/v1/models/tiny")) == (200, card)
    status, missing = asyncio.run(_get(env["hf"], "/v1/models/other"))
    assert status == 404 and missing["error"]["code"] == "model_not_found"


def _starts_fail(*model_paths: Path) -> list[str]:
    """Start a server on each path at once (they fail independently, before serving); each must
    exit 2. Returns their stderr, in order."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_earl.rollout.serve.server",
                "--port",
                str(free_port()),
                "--model-path",
                str(path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in model_paths
    ]
    errs = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        errs.append(err)
    return errs


def test_unservable_model_paths_fail_at_start_naming_why(env, tmp_path):
    config = json.loads((env["hf_dir"] / "config.json").read_text())
    rope = tmp_path / "rope"
    rope.mkdir()
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}
    (rope / "config.json").write_text(json.dumps(config))
    arch = tmp_path / "arch"
    arch.mkdir()
    config["architectures"] = ["MistralForCausalLM"]
    (arch / "config.json").write_text(json.dumps(config))
    partial = tmp_path / "partial"
    export_hf(
        [(n, t) for n, t in hf_named_tensors(_weights(2), MODEL) if "layers.1." not in n],
        MODEL,
        partial,
    )
    errs = _starts_fail(rope, arch, tmp_path / "nowhere", partial)
    assert "RoPE type 'dynamic'" in errs[0]
    assert "unsupported architecture ['MistralForCausalLM']" in errs[1]
    assert "does not exist" in errs[2]
    assert "lacks tensors" in errs[3]


def test_llama3_scaled_hf_directory_generates_what_transformers_generates_with_its_log_probs(
    tmp_path,
):
    from transformers import AutoModelForCausalLM

    from megatron_earl.convert.families import model_config_from_hf
    from megatron_earl.convert.tiny import save_tiny_hf, tiny_model_config
    from tests.tolerances import assert_fp32_close, gpt_terms

    hf_dir = save_tiny_hf("llama", tmp_path / "llama3", tie=True, rope="llama3")
    prompt = torch.randint(0, 100, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    server = _start(tmp_path, "llama3", str(hf_dir))  # starts while transformers generates
    try:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        expected = list(prompt)
        with torch.no_grad():  # greedy, full recompute; the original context is 8 positions
            for _ in range(NEW):
                expected.append(int(hf(torch.tensor([expected])).logits[0, -1].argmax()))
        server.wait_healthy(timeout_s=120)
        params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        answer = asyncio.run(_post(server.url, "/generate", body))
        got = answer["output_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([expected])).logits[0].float(), dim=-1)
    finally:
        server.stop(stop_timeout_s=20)
    assert got == expected[len(prompt) :]
    assert len(set(got)) > 3  # not one repeated token
    # Normalised over the real vocabulary (100 ids; serve's Megatron model pads it to 128):
    # transformers' log-probs within the fp32 bound of two summation orders.
    model = tiny_model_config("llama", tie=True, rope="llama3")
    assert (
        model.vocab_size == 100
        and model_config_from_hf(json.loads((hf_dir / "config.json").read_text())).padded_vocab_size
        == 128
    )
    want = torch.tensor([float(logprobs[len(prompt) - 1 + t, tok]) for t, tok in enumerate(got)])
    served = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    assert_fp32_close(served, want, gpt_terms(model, len(expected)))
