"""``serve``'s ``/generate`` parsing and response shape (``rollout.serve.generate_api``), and the
sampler's min-p filter: pure, no model.

* n samples per prompt, prompt-major, named as SGLang names batch items; per-prompt lists;
* values that would change the result and cannot be honoured: 400 naming the field; ignored
  fields are type-checked; every engine-bound value is checked for type/range/finiteness;
* SGLang's text trimming of the matched stop (``no_stop_trim``) and log-prob entry shapes;
* min-p: exactly the tokens with p >= min_p x p_max (after temperature) stay, and only rows
  that ask are filtered.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_earl.config.sampling import SamplingParams
from megatron_earl.rollout.embedded.sampling import filter_logits, sample_tokens
from megatron_earl.rollout.engine import FinishReason, FinishType, GenerateResult
from megatron_earl.rollout.serve.generate_api import (
    BadRequest,
    Options,
    logprobs_json,
    parse_generate,
    trimmed_text,
)


def parse(body, max_seq_len=64):
    return parse_generate(body, max_seq_len=max_seq_len, tokenize=lambda t: list(t.encode()))


def test_n_samples_are_prompt_major_with_sglang_ids():
    plan = parse({"input_ids": [[1, 2], [3]], "rid": "r", "sampling_params": {"n": 3}})
    assert plan.batched and len(plan.requests) == 6
    assert [r.input_ids for r in plan.requests] == [(1, 2)] * 3 + [(3,)] * 3
    assert [r.rid for r in plan.requests] == [f"r_{i}" for i in range(6)]
    single = parse({"text": "hi", "sampling_params": {"n": 2}, "rid": "x"})
    assert single.batched and [r.rid for r in single.requests] == ["x_0", "x_1"]
    one = parse({"input_ids": [1], "rid": "x"})
    assert not one.batched and one.requests[0].rid == "x"
    listed = parse({"input_ids": [[1], [2]], "rid": ["a", "b"], "sampling_params": {"n": 2}})
    assert [r.rid for r in listed.requests] == ["a_0", "a_1", "b_0", "b_1"]


def test_per_prompt_lists_and_logprob_options():
    plan = parse(
        {
            "input_ids": [[1, 2, 3], [4, 5]],
            "sampling_params": [{"temperature": 0}, {"min_p": 0.2, "max_new_tokens": None}],
            "return_logprob": [True, False],
            "logprob_start_len": [1, 0],
            "top_logprobs_num": 2,
        }
    )
    first, second = plan.requests
    assert first.sampling.temperature == 0 and second.sampling.min_p == 0.2
    assert second.sampling.max_new_tokens == 64 - 2  # null: up to the context limit
    assert (first.logprob_start_len, first.top_logprobs_num) == (1, 2)
    # without return_logprob nothing is computed (SGLang ignores the options then)
    assert (second.logprob_start_len, second.top_logprobs_num) == (-1, 0)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"lora_path": "a"}, "lora_path='a' is not supported by this server"),
        ({"lora_path": [None, "a"]}, "lora_path"),
        ({"image_data": "x.png"}, "image_data"),
        ({"token_ids_logprob": [1]}, "token_ids_logprob"),
        ({"data_parallel_rank": 2}, "data_parallel_rank"),
        ({"sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"sampling_params": {"regex": "a+"}}, "regex"),
        ({"sampling_params": {"logit_bias": {"1": 5.0}}}, "logit_bias"),
        ({"sampling_params": {"beam_width": 4}}, "beam_width"),
        ({"priority": "high"}, "priority must be int"),
        ({"log_metrics": 1}, "log_metrics must be bool"),
        ({"sampling_params": {"skip_special_tokens": "no"}}, "skip_special_tokens"),
        ({"bogus": 1}, "unknown field(s) ['bogus']"),
        ({"sampling_params": {"bogus": 1}}, "unknown field(s) ['bogus'] in sampling_params"),
        ({"sampling_params": {"min_p": float("nan")}}, "min_p must be a finite number"),
        ({"sampling_params": {"min_p": 1.5}}, "min_p must be in [0, 1]"),
        ({"sampling_params": {"n": 0}}, "sampling_params.n=0"),
        ({"sampling_params": {"n": "2"}}, "sampling_params.n must be an integer"),
        ({"sampling_params": {"n": 10**6}}, "sampling_params.n=1000000"),
        ({"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be >= 0"),
        ({"sampling_params": "fast"}, "sampling_params must be a JSON object"),
        ({"logprob_start_len": 5}, "logprob_start_len=5 must be -1 or in [0, 3]"),
        ({"logprob_start_len": -2}, "logprob_start_len=-2"),
        ({"top_logprobs_num": -1}, "top_logprobs_num must be >= 0"),
        ({"top_logprobs_num": 1.5}, "top_logprobs_num must be an integer"),
        ({"return_logprob": "yes"}, "return_logprob must be true, false or null"),
        ({"stream": 1}, "stream must be true, false or null"),
        ({"rid": 5}, "rid must be a string or a list"),
    ],
)
def test_bad_values_get_a_400_naming_the_field(body, needle):
    with pytest.raises(BadRequest) as err:
        parse({"input_ids": [1, 2, 3], **body})
    assert needle in str(err.value)


def test_batch_wide_rules():
    with pytest.raises(BadRequest, match="duplicate request ids"):
        parse({"input_ids": [[1], [2]], "rid": ["a", "a"]})
    with pytest.raises(BadRequest, match="one per prompt"):
        parse(
            {"input_ids": [[1], [2]], "return_logprob": [True, True], "sampling_params": {"n": 2}}
        )
    with pytest.raises(BadRequest, match="same for every prompt"):
        parse({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]})
    with pytest.raises(BadRequest, match="exactly one of input_ids or text"):
        parse({"input_ids": [1], "text": "a"})
    with pytest.raises(BadRequest, match="no tokenizer"):
        parse_generate({"text": "a"}, max_seq_len=64)


def test_ignored_and_neutral_values_change_nothing():
    plain = parse({"input_ids": [1, 2]})
    extra = {
        "session_id": "s",
        "priority": 3,
        "log_metrics": False,
        "custom_labels": {"a": "b"},
        "lora_path": [None],
        "routed_dp_rank": 0,
        "return_hidden_states": False,
        "sampling_params": {
            "skip_special_tokens": False,
            "repetition_penalty": 1,
            "logit_bias": {},
            "stop_regex": [],
            "stream_interval": 4,
        },
    }
    assert parse({"input_ids": [1, 2], **extra}).requests == plain.requests


def test_ignore_eos_drops_stop_token_ids():
    plan = parse({"input_ids": [1], "sampling_params": {"stop_token_ids": [7], "ignore_eos": True}})
    assert plan.requests[0].sampling.stop_token_ids == ()


def test_text_trims_the_matched_stop_unless_no_stop_trim():
    text_of = lambda ids: bytes(ids).decode()
    ids = list(b"abc\nzz")
    stop = FinishReason(FinishType.STOP, matched="\n")
    assert trimmed_text(ids, stop, Options(), text_of) == "abc"
    assert trimmed_text(ids, stop, Options(no_stop_trim=True), text_of) == "abc\n"
    token = FinishReason(FinishType.STOP, matched=ord("z"))
    assert trimmed_text(ids, token, Options(), text_of) == "abc\nz"
    assert trimmed_text(ids, token, Options(no_stop_trim=True), text_of) == "abc\nzz"
    length = FinishReason(FinishType.LENGTH)
    assert trimmed_text(ids, length, Options(), text_of) == "abc\nzz"


def test_logprob_entries_have_sglangs_shape():
    plan = parse(
        {
            "input_ids": [4, 5, 6, 7],
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 1,
        }
    )
    request, opts = plan.requests[0], plan.options[0]
    result = GenerateResult(
        rid="r",
        output_ids=(9,),
        output_logprobs=(-0.5,),
        finish_reason=FinishReason(FinishType.LENGTH),
        weight_version=0,
        input_logprobs=(-1.0, -2.0),
        input_top_logprobs=(((-0.1, 3),), ((-0.2, 4),)),
        output_top_logprobs=(((-0.3, 9),),),
    )
    meta = logprobs_json(request, result, opts, None)
    assert meta["input_token_logprobs"] == [[None, 5, None], [-1.0, 6, None], [-2.0, 7, None]]
    assert meta["output_token_logprobs"] == [[-0.5, 9, None]]
    assert meta["input_top_logprobs"] == [None, [[-0.1, 3, None]], [[-0.2, 4, None]]]
    assert meta["output_top_logprobs"] == [[[-0.3, 9, None]]]
    # -1 (SGLang's default): output log-probs only, no prompt entries
    default = parse({"input_ids": [4, 5], "return_logprob": True})
    meta = logprobs_json(default.requests[0], result, default.options[0], None)
    assert meta["input_token_logprobs"] == [] and "input_top_logprobs" not in meta


def test_min_p_keeps_exactly_the_tokens_over_min_p_times_the_max():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0])
    min_p = torch.tensor([0.1, 0.3, 0.05, 0.0], dtype=torch.float64)
    off_k, off_p = torch.full((4,), -1), torch.ones(4)
    out = filter_logits(logits, temperature, off_k, off_p, min_p)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    keep = probs >= min_p[:, None].float() * probs.max(dim=-1, keepdim=True).values
    assert torch.equal(torch.isfinite(out), keep)
    assert bool(torch.isfinite(out[3]).all())  # min_p = 0: the row is untouched
    assert 0 < int(keep[:3].sum()) < 150


def test_sampled_tokens_respect_min_p():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=gen) * 2
    params = [SamplingParams(min_p=0.5, seed=i) for i in range(64)]
    tokens, logprobs = sample_tokens(logits, 40, params, [random.Random(i) for i in range(64)])
    probs = torch.softmax(logits, dim=-1)
    for row, token in enumerate(tokens):
        assert probs[row, token] >= 0.5 * probs[row].max()
        assert math.isclose(logprobs[row], math.log(probs[row, token]), rel_tol=1e-5)
    free = [SamplingParams(seed=i) for i in range(64)]
    drawn, _ = sample_tokens(logits, 40, free, [random.Random(i) for i in range(64)])
    assert any(probs[r, t] < 0.5 * probs[r].max() for r, t in enumerate(drawn))  # can fail


def test_skip_special_tokens_false_keeps_special_tokens_in_text():
    def detokenize(ids, skip_special_tokens=True):  # id 0 is a special token "<s>"
        return "".join(
            "" if i == 0 and skip_special_tokens else "<s>" if i == 0 else "x" * i for i in ids
        )

    result = GenerateResult(
        rid="r",
        output_ids=(1, 0, 2),
        output_logprobs=(-0.1, -0.2, -0.3),
        finish_reason=FinishReason(FinishType.LENGTH),
        weight_version=0,
    )
    keep = parse({"input_ids": [1], "sampling_params": {"skip_special_tokens": False}})
    assert keep.response([result], detokenize)["text"] == "x<s>xx"
    assert parse({"input_ids": [1]}).response([result], detokenize)["text"] == "xxx"
    streamed = keep.partial_json(0, "r", [1, 0], [-0.1, -0.2], 0, detokenize)
    assert streamed["text"] == "x<s>"
