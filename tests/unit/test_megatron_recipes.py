"""Recipe fixtures (tests/fixtures/recipes/): Megatron-LM argument arrays of real models parse
with ``build_parser`` and give, field by field, the model of the same model's HF config.json;
a recipe with unsupported semantics-changing flags fails naming each."""

from __future__ import annotations

import json
import shlex
from dataclasses import fields
from pathlib import Path

import pytest

from megatron_earl.config import ConfigError
from megatron_earl.config.megatron_args import build_parser, config_from_megatron_args
from megatron_earl.config.model import ModelConfig
from megatron_earl.convert.families import hf_params_dtype, model_config_from_hf

RECIPES = Path(__file__).resolve().parents[1] / "fixtures" / "recipes"

# ModelConfig fields a recipe sets that an HF config.json does not describe (run settings).
RUN_ONLY = {
    "init_method_std",
    "attention_dropout",
    "hidden_dropout",
    "recompute_granularity",
    "recompute_num_layers",
    "transformer_impl",
    "attention_backend",
    "cp_comm_type",
    "sequence_parallel",
    "vocab_padding",  # Megatron-LM's rule at the recipe's TP (an HF config.json has no TP)
    "vocab_padding_tp",
}
# Fields compared by their effective value: kv_channels None means hidden / heads, and
# num_query_groups None means one group per head.
EFFECTIVE = {"kv_channels": "head_dim", "num_query_groups": "query_groups"}


def recipe_args(name: str) -> list[str]:
    return shlex.split((RECIPES / f"{name}.args").read_text(), comments=True)


def parse_recipe(name: str):
    args = build_parser().parse_args(recipe_args(name))
    sizes = (
        args.tensor_model_parallel_size
        * args.context_parallel_size
        * args.pipeline_model_parallel_size
    )
    return args, config_from_megatron_args(args, world_size=2 * sizes)


def compare_with_hf(model: ModelConfig, hf: dict) -> None:
    """Every architecture field of ``model`` equals the one converted from ``hf``, and the
    central ones equal the raw config.json keys."""
    expected = model_config_from_hf(
        hf, make_vocab_size_divisible_by=128, params_dtype=hf_params_dtype(hf)
    )
    diffs = []
    for f in fields(ModelConfig):
        if f.name in RUN_ONLY:
            continue
        name = EFFECTIVE.get(f.name, f.name)
        got, want = getattr(model, name), getattr(expected, name)
        if got != want:
            diffs.append(f"{name}: recipe {got!r} != HF {want!r}")
    raw = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": hf["num_attention_heads"],
        "query_groups": hf["num_key_value_heads"],
        "head_dim": hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "rotary_base": float(hf["rope_theta"]),
        "norm_epsilon": hf["rms_norm_eps"],
        "tie_embeddings": hf["tie_word_embeddings"],
        "params_dtype": hf["torch_dtype"],
    }
    diffs += [
        f"{k}: recipe {getattr(model, k)!r} != config.json {v!r}"
        for k, v in raw.items()
        if getattr(model, k) != v
    ]
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize(
    "name",
    [
        "llama3.1_8b",
        "qwen2.5_7b",
        "qwen3_4b",
        "qwen3_8b",
        "llama3_8b",
    ],
)
def test_recipe_matches_hf_config(name):
    _, cfg = parse_recipe(name)
    compare_with_hf(cfg.model, json.loads((RECIPES / f"{name}.hf_config.json").read_text()))


def test_recipe_attention_features():
    """What each recipe exists to exercise, stated directly."""
    qwen25 = parse_recipe("qwen2.5_7b")[1].model
    assert qwen25.add_qkv_bias and not qwen25.qk_layernorm and qwen25.query_groups == 4
    qwen3_4b = parse_recipe("qwen3_4b")[1].model
    assert qwen3_4b.qk_layernorm and qwen3_4b.tie_embeddings
    assert qwen3_4b.head_dim == 128 != qwen3_4b.hidden_size // qwen3_4b.num_attention_heads
    llama3 = parse_recipe("llama3_8b")[1].model
    assert llama3.query_groups == 8 < llama3.num_attention_heads and not llama3.tie_embeddings


def test_recipe_sequence_parallel_is_mapped():
    """--sequence-parallel turns Megatron's sequence parallelism on (layouts with tp > 1)."""
    llama31 = parse_recipe("llama3.1_8b")[1]
    assert llama31.model.sequence_parallel and llama31.layouts.train.startswith("tp4cp2")
    assert not parse_recipe("llama3_8b")[1].model.sequence_parallel


def test_recipe_optimizer_and_schedule():
    _, qwen25 = parse_recipe("qwen2.5_7b")
    t = qwen25.train
    assert (t.optimizer, t.lr_decay_style, t.lr_decay_steps) == ("adam", "linear", 400)
    assert (t.lr_warmup_fraction, t.lr_warmup_steps, t.min_lr) == (0.05, 0, 5e-8)
    _, qwen3 = parse_recipe("qwen3_8b")
    t = qwen3.train
    assert (t.optimizer, t.sgd_momentum) == ("sgd", 0.8)
    assert (t.lr_decay_style, t.lr_wsd_decay_style, t.lr_wsd_decay_steps) == ("WSD", "cosine", 20)
    assert qwen3.layouts.train == "tp4cp4pp2vpp2dp2"
    _, llama3 = parse_recipe("llama3_8b")
    t = llama3.train
    assert (t.lr_decay_style, t.lr_warmup_steps, t.lr_warmup_init) == ("cosine", 20, 1e-7)
    assert t.lr_decay_steps is None  # Megatron-LM: decay over the whole run


def test_no_effect_flags_are_listed_once_at_start_up(caplog):
    with caplog.at_level("WARNING", logger="megatron_earl.config.megatron_args"):
        parse_recipe("qwen2.5_7b")
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(lines) == 1
    for flag in ("--data-path", "--wandb-project", "--use-flash-attn", "--no-position-embedding"):
        assert flag in lines[0]
    assert "--lr" not in lines[0].split()


def test_unsupported_flags_fail_naming_each():
    with pytest.raises(ConfigError) as err:
        parse_recipe("bad_unsupported_flag")
    message = str(err.value)
    assert "--multi-latent-attention: only SwiGLU decoder models" in message
    assert "--decoupled-lr:" in message and "use --optimizer adam|sgd" in message
