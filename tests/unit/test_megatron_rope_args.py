"""Megatron-LM's RoPE flags (``config/megatron_args._rope_tree``): Llama 3.x scaling
(``--use-rope-scaling``), linear interpolation (``--rotary-seq-len-interpolation-factor``) and YaRN
(``--position-embedding-type yarn`` + ``--rotary-scaling-factor`` / ``--yarn-*`` / ``--mscale*``)
map onto the model config the same HF config converts to; conflicting or unsupported flags are one
error naming them."""

from __future__ import annotations

import shlex

import pytest

from megatron_earl.config import ConfigError
from megatron_earl.config.megatron_args import build_parser, config_from_megatron_args
from megatron_earl.convert.families import model_config_from_hf

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 320 --swiglu "
    "--disable-bias-linear --normalization RMSNorm --seq-length 128 "
    "--max-position-embeddings 131072 --position-embedding-type rope "
)
ROPE_FIELDS = (
    "rotary_base",
    "rope_type",
    "rope_scaling_factor",
    "rope_original_max_position_embeddings",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
)


def _model(flags: str):
    args = build_parser().parse_args(shlex.split(BASE + flags))
    return config_from_megatron_args(args, world_size=1).model


def _hf(rope: dict, theta: float) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "vocab_size": 320,
        "max_position_embeddings": 131072,
        "rope_theta": theta,
        "rope_scaling": rope,
    }


def _rope(model) -> dict:
    return {f: getattr(model, f) for f in ROPE_FIELDS}


def test_llama31_rope_scaling_equals_its_hf_config():
    model = _model("--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8")
    llama31 = {  # meta-llama/Llama-3.1-8B config.json rope_scaling
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    assert _rope(model) == _rope(model_config_from_hf(_hf(llama31, 500000.0)))
    assert _model("--use-rope-scaling").rope_scaling_factor == 8.0  # Megatron-LM's default


def test_yarn_flags_equal_the_hf_config():
    model = _model(
        "--position-embedding-type yarn --rotary-scaling-factor 4 "
        "--yarn-original-max-position-embeddings 32768"
    )
    qwen25 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert _rope(model) == _rope(model_config_from_hf(_hf(qwen25, 10000.0)))
    pair = _model(
        "--position-embedding-type yarn --rotary-scaling-factor 4 --mscale 0.7 "
        "--mscale-all-dim 0.7 --yarn-beta-fast 16"
    )
    assert (pair.yarn_mscale, pair.yarn_mscale_all_dim, pair.yarn_beta_fast) == (0.7, 0.7, 16.0)
    assert pair.rope_original_max_position_embeddings == 4096  # Megatron-LM's default


def test_linear_interpolation_and_no_scaling():
    model = _model("--rotary-seq-len-interpolation-factor 4")
    assert (model.rope_type, model.rope_scaling_factor) == ("linear", 4.0)
    assert _model("").rope_type == "default"


@pytest.mark.parametrize(
    "flags, fragments",
    [
        ("--rope-scaling-factor 32", ["--rope-scaling-factor", "without --use-rope-scaling"]),
        # Megatron-LM's default value given explicitly: still the conflict, named
        ("--rope-scaling-factor 8.0", ["--rope-scaling-factor 8.0", "without --use-rope-scaling"]),
        (
            "--use-rope-scaling --rotary-seq-len-interpolation-factor 2",
            ["--use-rope-scaling and --rotary-seq-len-interpolation-factor"],
        ),
        (
            "--use-rope-scaling --position-embedding-type yarn",
            ["--use-rope-scaling and --position-embedding-type yarn"],
        ),
        (
            "--yarn-beta-fast 16 --rotary-scaling-factor 4",
            ["--rotary-scaling-factor, --yarn-beta-fast given without --position-embedding-type"],
        ),
        ("--rotary-percent 0.5", ["--rotary-percent 0.5", "only 1.0"]),
        (
            "--position-embedding-type yarn --rotary-scaling-factor 4 --mscale 0.7",
            ["--mscale 0.7 with --mscale-all-dim 0.0"],
        ),
        (
            "--position-embedding-type yarn --no-yarn-correction-range-round-to-int",
            ["--no-yarn-correction-range-round-to-int is not supported"],
        ),
    ],
)
def test_conflicting_or_unsupported_rope_flags_are_named(flags, fragments):
    with pytest.raises((ConfigError, ValueError)) as err:
        _model(flags)
    for fragment in fragments:
        assert fragment in str(err.value)
