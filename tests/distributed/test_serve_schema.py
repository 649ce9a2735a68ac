"""``serve``'s ``/generate`` with SGLang's whole request schema, against the model itself.

One in-process ``megatron-earl serve`` (real HTTP server, engine and model; world of one) is
driven with SGLang bodies and its answers are checked against a direct computation with the same
model (a full forward of the whole sequence, no KV cache):

* a body giving every field of SGLang's schema at its default answers as the plain body does;
  fields this server cannot honour get a 400 naming them when given a value that would matter;
* ``min_p``: every sampled token has probability >= min_p x the most likely one's (and without
  min_p some do not: the check can fail);
* ``n``: n samples per prompt, prompt-major, as a list;
* ``return_logprob`` with ``logprob_start_len`` / ``top_logprobs_num``: prompt and output
  log-probs and top log-probs equal the model's log-softmax (shared prefills of n samples too,
  and ``max_new_tokens=0``: scoring only);
* ``stream``: one SSE event per sequence with its ``index``, then ``[DONE]``.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.testing.distributed import run_distributed
from tests.tolerances import fp32_tol, gpt_terms

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    vocab_size=256,
    make_vocab_size_divisible_by=64,
    init_method_std=0.4,
)
PROMPT = [5, 17, 99, 3, 42, 7, 200]
OTHER = [9, 8, 7]
MIN_P = 0.3
LOGPROB_TERMS = gpt_terms(MODEL, 64)  # --max-seq-len 64
"""A log-prob's chain of fp32 sums: the server's cached, batched decode orders them otherwise
than the reference's one forward of the whole sequence."""


def _tol(ref) -> float:
    """The log-probs' fp32 bound at the magnitude of the reference row(s) ``ref`` (~2e-4 x it); a
    log-prob of the wrong position or token is off by O(1)."""
    return fp32_tol(LOGPROB_TERMS, float(ref.abs().max()))


def _serve(config_path: str, neutral: str) -> dict:
    import asyncio

    import torch
    from aiohttp.test_utils import TestClient, TestServer

    from megatron_earl.rollout.serve.server import Server, build_engine, parse_args

    args = ["--seed", "3", "--max-seq-len", "64", "--model-config", config_path]
    engine, _ = build_engine(parse_args(args))
    server = Server(engine, "random")
    engine.detokenize = server.detokenize
    gpt = engine.model_chunks[0]

    def reference(seq: list[int]) -> torch.Tensor:
        """log-softmax [len(seq), V] of a full forward (position i predicts token i + 1)."""
        with torch.no_grad():
            logits = gpt(torch.tensor([seq]), torch.arange(len(seq))[None], None)
        return torch.log_softmax(logits[0].float(), dim=-1)

    out: dict = {}

    async def main() -> None:
        await engine.start()
        client = TestClient(TestServer(server.app()))
        await client.start_server()

        async def post(body):
            resp = await client.post("/generate", json=body)
            return resp.status, (await resp.json() if resp.status == 200 else await resp.text())

        try:
            greedy = {"max_new_tokens": 6, "temperature": 0}
            out["plain"] = await post({"input_ids": PROMPT, "sampling_params": greedy})
            body = json.loads(neutral)  # every SGLang field at its default
            body["sampling_params"].update(greedy)
            out["neutral"] = await post(body)
            out["refused"] = [
                await post({"input_ids": PROMPT, **extra})
                for extra in (
                    {"lora_path": "adapter"},
                    {"sampling_params": {"frequency_penalty": 0.5}},
                    {"return_hidden_states": True},
                    {"routed_dp_rank": 1},
                    {"bogus": 1},
                )
            ]
            sampled = {"max_new_tokens": 8, "temperature": 1.0, "n": 16}
            for name, min_p in (("min_p", MIN_P), ("no_min_p", 0.0)):
                status, items = await post(
                    {"input_ids": PROMPT, "sampling_params": {**sampled, "min_p": min_p}}
                )
                assert status == 200, items
                out[name] = [
                    (item["output_ids"], reference(PROMPT + item["output_ids"])) for item in items
                ]
            out["n"] = await post(
                {
                    "input_ids": [PROMPT, OTHER],
                    "rid": "grp",
                    "sampling_params": {"max_new_tokens": 5, "n": 3, "sampling_seed": 1},
                }
            )
            logprob = {
                "input_ids": PROMPT,
                "return_logprob": True,
                "logprob_start_len": 2,
                "top_logprobs_num": 3,
                "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "n": 3},
            }
            status, items = await post(logprob)
            assert status == 200, items
            out["logprob"] = [(item, reference(PROMPT + item["output_ids"])) for item in items]
            scoring = {
                "input_ids": [PROMPT, OTHER],
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0},
            }
            out["scoring"] = (await post(scoring), reference(PROMPT), reference(OTHER))
            stream = {
                "input_ids": [PROMPT, OTHER],
                "stream": True,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            }
            resp = await client.post("/generate", json=stream)
            out["stream"] = (resp.status, resp.headers["Content-Type"], await resp.text())
        finally:
            await client.close()
            await engine.shutdown()

    asyncio.run(main())
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.unit.test_sglang_contract import load_schema, neutral_body

    neutral = json.dumps({**neutral_body(load_schema()), "input_ids": PROMPT})
    path = tmp_path_factory.mktemp("schema") / "model.json"
    path.write_text(json.dumps(MODEL.to_dict()))
    return run_distributed(_serve, 1, args=(str(path), neutral), timeout_s=300)[0]


def test_every_field_at_its_default_answers_as_the_plain_body(served):
    (status, plain), (status_all, neutral) = served["plain"], served["neutral"]
    assert status == status_all == 200, neutral
    assert neutral["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == 6


def test_values_this_server_cannot_honour_get_400_naming_the_field(served):
    needles = ["lora_path", "frequency_penalty", "return_hidden_states", "routed_dp_rank"]
    for (status, text), needle in zip(served["refused"], needles):
        assert status == 400 and needle in text and "not supported by this server" in text
    status, text = served["refused"][-1]
    assert status == 400 and "unknown field(s) ['bogus']" in text


def _violations(samples, min_p: float) -> int:
    """Sampled tokens whose probability (temperature 1) is below min_p x the row's maximum."""
    count = 0
    for ids, ref in samples:
        start = len(PROMPT) - 1
        for t, token in enumerate(ids):
            probs = ref[start + t, : MODEL.vocab_size].exp()
            # both log-probs (token, max) may differ from the server's by _tol
            count += int(probs[token] < min_p * probs.max() * math.exp(-2 * _tol(ref)))
    return count


def test_min_p_drops_tokens_below_min_p_times_the_max(served):
    assert len(served["min_p"]) == 16
    assert _violations(served["min_p"], MIN_P) == 0
    assert _violations(served["no_min_p"], MIN_P) > 0  # the check can fail


def test_n_samples_per_prompt_prompt_major(served):
    status, items = served["n"]
    assert status == 200 and isinstance(items, list) and len(items) == 6
    assert [it["meta_info"]["prompt_tokens"] for it in items] == [7, 7, 7, 3, 3, 3]
    assert [it["meta_info"]["id"] for it in items] == [f"grp_{i}" for i in range(6)]
    assert all(len(it["output_ids"]) == 5 for it in items)
    # one seed for the prompt's samples: the same tokens (SGLang's sampling_seed is per request)
    assert items[0]["output_ids"] == items[1]["output_ids"] == items[2]["output_ids"]


def test_prompt_and_top_logprobs_equal_the_models(served):
    import torch

    for item, ref in served["logprob"]:
        tol = _tol(ref)
        meta, ids = item["meta_info"], item["output_ids"]
        seq = PROMPT + ids
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == PROMPT[2:] and entries[0][0] is None
        for j, (lp, tok, text) in enumerate(entries[1:], start=3):
            assert abs(lp - float(ref[j - 1, tok])) <= tol
            assert text == bytes([tok]).decode(errors="replace")  # the byte tokenizer's text
        out_lps = meta["output_token_logprobs"]
        assert [e[1] for e in out_lps] == ids and meta["output_token_logprobs_length"] == 5
        for t, (lp, tok, _) in enumerate(out_lps):
            assert abs(lp - float(ref[len(PROMPT) - 1 + t, tok])) <= tol
            assert tok == int(torch.argmax(ref[len(PROMPT) - 1 + t, : MODEL.vocab_size]))
        tops_in, tops_out = meta["input_top_logprobs"], meta["output_top_logprobs"]
        assert tops_in[0] is None and len(tops_in) == len(entries) and len(tops_out) == 5
        positions = list(range(2, len(PROMPT) - 1)) + list(range(len(PROMPT) - 1, len(seq) - 1))
        for pos, top in zip(positions, tops_in[1:] + tops_out):
            values, top_ids = ref[pos, : MODEL.vocab_size].topk(3)
            assert [e[1] for e in top] == top_ids.tolist()
            assert max(abs(e[0] - v) for e, v in zip(top, values.tolist())) <= tol
    # the three samples shared one prefill and read the same prompt log-probs
    firsts = [item["meta_info"]["input_token_logprobs"] for item, _ in served["logprob"]]
    assert firsts[0] == firsts[1] == firsts[2]


def test_max_new_tokens_0_scores_the_prompt(served):
    (status, items), ref, ref_other = served["scoring"]
    assert status == 200 and len(items) == 2
    for item, prompt, r in zip(items, (PROMPT, OTHER), (ref, ref_other)):
        assert item["output_ids"] == [] and item["meta_info"]["finish_reason"]["type"] == "length"
        entries = item["meta_info"]["input_token_logprobs"]
        assert len(entries) == len(prompt) and entries[0] == [None, prompt[0], None]
        for j in range(1, len(prompt)):
            assert abs(entries[j][0] - float(r[j - 1, prompt[j]])) <= _tol(r)


def test_stream_sends_an_event_per_token_then_done(served):
    status, content_type, text = served["stream"]
    assert status == 200 and content_type.startswith("text/event-stream")
    events = [line[len("data: ") :] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    items = [json.loads(e) for e in events[:-1]]
    assert len(items) == 8  # 2 sequences x 4 tokens, SGLang's cumulative events
    for index in (0, 1):
        seq = [it for it in items if it["index"] == index]
        final = seq[-1]
        assert len(final["output_ids"]) == 4 and final["meta_info"]["finish_reason"] is not None
        for n, it in enumerate(seq[:-1], start=1):
            assert it["meta_info"]["finish_reason"] is None
            assert it["output_ids"] == final["output_ids"][:n]
            lps = it["meta_info"]["output_token_logprobs"]
            assert lps == final["meta_info"]["output_token_logprobs"][:n]
    _, plain = served["plain"]
    assert [it for it in items if it["index"] == 0][-1]["output_ids"] == plain["output_ids"][:4]


def _steps_run() -> list:
    """The engine's forward batches for plain requests, then one asking for prompt log-probs."""
    import asyncio

    from megatron_earl.config.sampling import SamplingParams
    from megatron_earl.rollout.embedded.engine import run_engine
    from megatron_earl.rollout.engine import GenerateRequest
    from megatron_earl.rollout.serve.server import build_engine, parse_args

    engine, _ = build_engine(parse_args(["--max-seq-len", "64"]))
    real, batches = engine._forward, []

    def recording(batch):
        batches.append((batch.is_decode, batch.logits_from))
        return real(batch)

    engine._forward = recording
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=5, seed=1)

    async def driver(eng):
        await asyncio.gather(*(eng.generate(GenerateRequest(tuple(PROMPT), params)) for _ in "ab"))
        plain = len(batches)
        await eng.generate(
            GenerateRequest(tuple(PROMPT), params, logprob_start_len=3, top_logprobs_num=2)
        )
        return batches[:plain], batches[plain:]

    return run_engine(engine, driver)


def test_default_path_computes_no_extra_logits():
    plain, asked = run_distributed(_steps_run, 1, timeout_s=120)[0]
    assert all(logits_from == () for _, logits_from in plain) and len(plain) == 3
    # only the prefill of the request that asks returns more than its last token's logits
    assert asked[0] == (False, (3,)) and all(f == () for _, f in asked[1:])
