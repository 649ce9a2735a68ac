"""Conversion pieces without processes: family configs both ways, tensor mapping round trips, the
grouped-QKV layout, streaming (one layer per read), and bad input (unsupported architecture, RoPE
scaling, shape mismatch, missing shards, incompatible layout, existing output) with clear errors and
no output directory left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert import mapping
from megatron_earl.convert.cli import main as convert_main
from megatron_earl.convert.cli import parse_size
from megatron_earl.convert.convert import hf_to_mcore
from megatron_earl.convert.dcp import check_checkpoint
from megatron_earl.convert.families import (
    ConversionError,
    family_by_name,
    family_of,
    hf_config_from_model,
    model_config_from_hf,
)
from megatron_earl.convert.hf_io import HFReader
from megatron_earl.convert.tiny import TINY_ROPE, tiny_model_config, write_random_hf

FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("rope", sorted(TINY_ROPE))
def test_config_round_trip(family, tie, rope):
    model = tiny_model_config(family, tie=tie, num_layers=3, rope=rope)
    cfg = hf_config_from_model(model, family_by_name(family))
    assert family_of(cfg).name == family
    back = model_config_from_hf(cfg, make_vocab_size_divisible_by=16, params_dtype="float32")
    assert back == ModelConfig(**{**model.to_dict(), "init_method_std": back.init_method_std})


def _random_layer(model: ModelConfig, layer: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(layer)
    return {n: torch.randn(s, generator=gen) for n, s in mapping.hf_shapes(model, layer).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_mapping_round_trip_is_bitwise(family):
    model = tiny_model_config(family)
    hf = _random_layer(model, 1)
    mcore = mapping.hf_layer_to_mcore(hf, model, 1)
    assert {k: tuple(v.shape) for k, v in mcore.items()} == mapping.mcore_layer_shapes(model)
    back = mapping.mcore_layer_to_hf(mcore, model, 1)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    for key, tensor in mcore.items():  # the per-tensor API used for pushing weights
        for name, part in mapping.mcore_to_hf_tensors(mapping.LAYER_PREFIX + key, tensor, model, 1):
            assert torch.equal(part, hf[name]), name


def test_qkv_is_grouped_per_kv_group():
    model = ModelConfig(hidden_size=8, num_attention_heads=4, num_query_groups=2, kv_channels=1)
    q = torch.arange(4.0).reshape(4, 1).expand(4, 8)  # head i has rows == i
    k = 10 + torch.arange(2.0).reshape(2, 1).expand(2, 8)
    v = 20 + torch.arange(2.0).reshape(2, 1).expand(2, 8)
    hf = {
        **{n: torch.zeros(s) for n, s in mapping.hf_shapes(model, 0).items()},
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
    }
    qkv = mapping.hf_layer_to_mcore(hf, model, 0)["self_attention.linear_qkv.weight"]
    assert qkv[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # [q_g; k_g; v_g] per group g


def test_vocab_padding_both_ways():
    model = tiny_model_config("llama")  # vocab 100 padded to 112
    emb = torch.randn(100, model.hidden_size)
    padded = mapping.pad_vocab("emb", emb, model)
    assert padded.shape[0] == model.padded_vocab_size == 112 and not padded[100:].any()
    assert torch.equal(mapping.unpad_vocab(mapping.EMBEDDING, padded, model), emb)


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    return write_random_hf("qwen3", tmp_path / "hf", tiny_model_config("qwen3", num_layers=3))


def test_hf_to_mcore_reads_one_layer_at_a_time(hf_dir, tmp_path, monkeypatch):
    reads: list[list[str]] = []
    original = HFReader.read

    def spy(self, names):
        reads.append(list(names))
        return original(self, names)

    monkeypatch.setattr(HFReader, "read", spy)
    model = hf_to_mcore(hf_dir, tmp_path / "out", make_vocab_size_divisible_by=16)
    layers_per_read = [
        {n.split(".")[2] for n in names if n.startswith("model.layers.")} for names in reads
    ]
    assert [len(s) for s in layers_per_read] == [0] + [1] * model.num_layers
    meta = check_checkpoint(tmp_path / "out")
    qkv = meta[mapping.LAYER_PREFIX + "self_attention.linear_qkv.weight"]
    assert qkv.size[0] == 3 and len(qkv.chunks) == 3  # one chunk per layer
    assert not list(tmp_path.glob("out.tmp-*"))


def test_cli_hf_to_mcore(hf_dir, tmp_path, capsys):
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "metadata.json").is_file()
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20


def _rewrite_config(hf_dir: Path, **changes) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture.*GPT2LMHeadModel"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}},
            r"RoPE type 'dynamic' .* supported: \['default', 'linear', 'llama3', 'yarn'\]",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
            r"config.json: rope_type='llama3' requires \['rope_scaling_factor'\]",
        ),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"num_hidden_layers": 4}, r"missing tensors \['model.layers.3"),
    ],
)
def test_bad_config_is_a_clear_error(hf_dir, tmp_path, changes, message):
    _rewrite_config(hf_dir, **changes)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_shape_mismatch_names_the_tensor_and_leaves_no_output(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.2.self_attn.k_proj.weight"  # the last layer: earlier ones are written
    shard = hf_dir / index[name]
    tensors = load_file(shard)
    tensors[name] = torch.zeros(8, 32)
    save_file(tensors, shard)
    with pytest.raises(ConversionError, match=rf"{name}: shape \(8, 32\) != expected \(32, 32\)"):
        hf_to_mcore(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_missing_hf_shard_names_the_file(hf_dir, tmp_path):
    (hf_dir / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(ConversionError, match=r"model-00002-of-00004\.safetensors is missing"):
        hf_to_mcore(hf_dir, tmp_path / "out")


def test_missing_checkpoint_shard_names_the_file(hf_dir, tmp_path):
    hf_to_mcore(hf_dir, tmp_path / "out")
    victim = sorted((tmp_path / "out").glob("*.distcp"))[1]
    victim.unlink()
    with pytest.raises(ConversionError, match=f"{victim.name} is missing"):
        check_checkpoint(tmp_path / "out")
    with pytest.raises(ConversionError, match=r"common\.pt not found"):
        (tmp_path / "out" / "common.pt").unlink()
        check_checkpoint(tmp_path / "out")


def test_incompatible_target_layout_names_the_values(hf_dir, tmp_path):
    with pytest.raises(ConversionError, match=r"tp=3.*num_attention_heads \(4\) % tp \(3\)"):
        hf_to_mcore(hf_dir, tmp_path / "out", tp=3)
    with pytest.raises(ConversionError, match=r"num_layers \(3\) % \(pp \(2\)"):
        hf_to_mcore(hf_dir, tmp_path / "out", pp=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True])
def test_agrees_with_the_engine_mapping(family, tie):
    """``models/hf_mapping.py`` (weight push to SGLang) and this converter must never diverge."""
    hf_mapping = pytest.importorskip("megatron_earl.models.hf_mapping")
    model = tiny_model_config(family, tie=tie, num_layers=2)
    hf = {n: t for layer in range(2) for n, t in _random_layer(model, layer).items()}
    gen = torch.Generator().manual_seed(9)
    hf[mapping.HF_EMBEDDING] = torch.randn(model.vocab_size, model.hidden_size, generator=gen)
    hf[mapping.HF_FINAL_NORM] = torch.randn(model.hidden_size, generator=gen)
    if not tie:
        hf[mapping.HF_OUTPUT] = torch.randn(model.vocab_size, model.hidden_size, generator=gen)
    full = hf_mapping.hf_to_megatron(hf, model)
    for layer in range(2):
        ours = mapping.hf_layer_to_mcore(_random_layer(model, layer), model, layer)
        for suffix, tensor in ours.items():
            assert torch.equal(full[mapping.LAYER_PREFIX + suffix][layer], tensor), suffix
    assert torch.equal(
        full[mapping.EMBEDDING], mapping.pad_vocab("e", hf[mapping.HF_EMBEDDING], model)
    )
    assert hf_mapping.full_megatron_to_hf(full, model).keys() == hf.keys()


LLAMA_32_1B = {  # meta-llama/Llama-3.2-1B config.json (transformers 4.x: rope_scaling)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 16,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def test_llama_32_config_both_ways():
    """Llama 3.2 1B: llama3 scaling from the 4.x ``rope_scaling`` dict, tied embeddings; written
    back as ``rope_parameters`` (transformers 5) and ``rope_scaling`` (4.x, SGLang), which read
    back to the same model."""
    model = model_config_from_hf(LLAMA_32_1B)
    assert model.tie_embeddings and model.rotary_base == 500000.0
    assert (model.rope_type, model.rope_scaling_factor) == ("llama3", 32.0)
    assert (
        model.rope_original_max_position_embeddings,
        model.rope_low_freq_factor,
        model.rope_high_freq_factor,
    ) == (8192, 1.0, 4.0)
    out = hf_config_from_model(model, family_by_name("llama"), base=LLAMA_32_1B)
    assert out["rope_parameters"] == {**LLAMA_32_1B["rope_scaling"], "rope_theta": 500000.0}
    assert out["rope_scaling"] == LLAMA_32_1B["rope_scaling"]
    assert model_config_from_hf(out) == model
    new_style = {k: v for k, v in out.items() if k != "rope_scaling"}
    assert model_config_from_hf(new_style) == model


def test_qwen25_yarn_config():
    """Qwen2.5's YaRN recipe (``"type": "yarn"``, the 4.x spelling)."""
    cfg = hf_config_from_model(tiny_model_config("qwen2"), family_by_name("qwen2"))
    del cfg["rope_parameters"]
    cfg["rope_scaling"] = {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model = model_config_from_hf(cfg)
    assert (model.rope_type, model.rope_scaling_factor) == ("yarn", 4.0)
    assert (model.rope_original_max_position_embeddings, model.yarn_beta_fast) == (32, 32.0)
    assert model.yarn_mscale is None and model.yarn_mscale_all_dim is None


@pytest.mark.parametrize(
    "params, message",
    [
        (
            {"rope_type": "llama3", "factor": 8.0, "beta_fast": 32},
            r"RoPE parameters \['beta_fast'\] of rope_type 'llama3'",
        ),
        ({"rope_type": "longrope", "factor": 8.0}, "RoPE type 'longrope'"),
        (
            {"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0},
            "attention_factor=2.0 differs",
        ),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, "truncate=false"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary"),
    ],
)
def test_unsupported_rope_parameters_are_named(params, message):
    cfg = hf_config_from_model(tiny_model_config("llama"), family_by_name("llama"))
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **params}
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf(cfg)
