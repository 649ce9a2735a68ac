"""The start-up check of a run's SGLang engines (``rollout.sglang.identity.check_engines``): what
each engine says it is against what the run is configured for."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.rollout.sglang.identity import (
    EngineIdentity,
    EngineMismatch,
    _read_config,
    check_engines,
)

MODEL = ModelConfig(
    num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=256
)
HF = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 64,
}
SGLANG = EngineIdentity(
    url="http://a:1",
    version="0.5.23",
    is_serve=False,
    tp_size=2,
    device="cpu",
    architectures=("LlamaForCausalLM",),
    model_type="llama",
    model_path="/m",
    hf_config=HF,
)
PUSHABLE = SGLangConfig(weight_update="distributed")


def test_engines_that_match_pass_and_give_their_tp_size():
    check = check_engines([SGLANG, dataclasses.replace(SGLANG, url="http://b:1")], PUSHABLE, MODEL)
    assert check.problems == [] and check.warnings == [] and check.engine_tp == 2
    check.raise_problems()


def test_a_tp_size_that_disagrees_is_refused_naming_both():
    check = check_engines([SGLANG], dataclasses.replace(PUSHABLE, engine_tp=1), MODEL)
    assert check.problems == [
        "http://a:1 runs with tp_size=2, rollout.sglang.engine_tp is 1 (leave it unset to "
        "take the engines')"
    ]
    mixed = [SGLANG, dataclasses.replace(SGLANG, url="http://b:1", tp_size=4)]
    assert (
        "TP sizes differ: http://a:1 tp_size=2, http://b:1 tp_size=4"
        in check_engines(mixed, PUSHABLE, MODEL).problems[0]
    )


def test_the_portable_payload_is_refused_for_real_sglang_only():
    portable = SGLangConfig(weight_update="tensor", tensor_payload="portable")
    with pytest.raises(EngineMismatch, match="cannot read tensor_payload 'portable'"):
        check_engines([SGLANG], portable, MODEL).raise_problems()
    serve = dataclasses.replace(SGLANG, is_serve=True)
    assert check_engines([serve], portable, MODEL).problems == []
    sglang_payload = SGLangConfig(weight_update="tensor", tensor_payload="sglang")
    assert check_engines([SGLANG], sglang_payload, MODEL).problems == []


def test_nccl_to_a_cpu_engine_is_refused():
    nccl = SGLangConfig(weight_update="distributed", group_backend="nccl")
    assert "needs group_backend 'gloo'" in check_engines([SGLANG], nccl, MODEL).problems[0]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"architectures": ("Qwen3ForCausalLM",)}, "architecture Qwen3ForCausalLM, the trainer"),
        ({"hf_config": {**HF, "vocab_size": 300}}, "vocab_size=300, the trainer's model has"),
        ({"hf_config": {**HF, "num_key_value_heads": 2}}, "num_key_value_heads=2"),
        ({"hf_config": {**HF, "intermediate_size": 128}}, "intermediate_size=128"),
    ],
)
def test_another_model_is_refused_naming_the_first_difference(change, needle):
    engine = dataclasses.replace(SGLANG, **change)
    problems = check_engines([engine], PUSHABLE, MODEL).problems
    assert len(problems) == 1 and problems[0].startswith("http://a:1 serves another model: ")
    assert needle in problems[0]


def test_an_untested_sglang_version_is_a_warning():
    check = check_engines([dataclasses.replace(SGLANG, version="0.6.0")], PUSHABLE, MODEL)
    assert check.problems == []
    assert check.warnings == ["http://a:1 runs SGLang 0.6.0; this project is tested with 0.5.23"]


def test_the_engines_config_json_is_read_when_this_host_sees_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF, "architectures": ["X"]}))
    assert _read_config(str(tmp_path))["vocab_size"] == 256
    assert _read_config(str(tmp_path / "absent")) is None
    nested = {"text_config": {"vocab_size": 7}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert _read_config(str(tmp_path)) == {"vocab_size": 7}
