"""Mixture-of-experts conversion without processes: Qwen3-MoE and Mixtral configs both ways (the
published Qwen3-30B-A3B config included), the expert tensor layout and its bitwise round trip,
one layer per read, and every MoE setting the mapping cannot represent refused with the field
named and no output left behind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert import mapping
from megatron_earl.convert.cli import main as convert_main
from megatron_earl.convert.convert import hf_to_mcore, mcore_to_hf
from megatron_earl.convert.dcp import check_checkpoint
from megatron_earl.convert.families import (
    ConversionError,
    family_by_name,
    family_for_model,
    family_of,
    hf_config_from_model,
    model_config_from_hf,
)
from megatron_earl.convert.hf_io import HFReader
from megatron_earl.convert.tiny import tiny_model_config, write_random_hf

MOE_FAMILIES = ("qwen3_moe", "mixtral")

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json as published (transformers 4.x fields)
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_config_round_trip(family):
    model = tiny_model_config(family, num_layers=3)
    cfg = hf_config_from_model(model, family_by_name(family))
    assert family_of(cfg).name == family_for_model(model).name == family
    back = model_config_from_hf(cfg, make_vocab_size_divisible_by=16, params_dtype="float32")
    assert back == ModelConfig(**{**model.to_dict(), "init_method_std": back.init_method_std})


def test_qwen3_30b_a3b_config_both_ways():
    model = model_config_from_hf(QWEN3_30B_A3B)
    assert (model.num_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (128, 8, 768)
    assert model.qk_layernorm and not model.add_qkv_bias and model.head_dim == 128
    assert model.moe_router_score_function == "softmax"  # top-k of logits, softmax over those k
    assert round(model.num_parameters() / 1e9, 1) == 30.5  # as published
    out = hf_config_from_model(model, family_by_name("qwen3_moe"), base=QWEN3_30B_A3B)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert out[key] == QWEN3_30B_A3B[key], key
    assert model_config_from_hf(out) == model
    # transformers 5 saves the count as num_local_experts; both names are read
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert model_config_from_hf({**renamed, "num_local_experts": 128}) == model


def _random_layer(model: ModelConfig, layer: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(layer)
    return {n: torch.randn(s, generator=gen) for n, s in mapping.hf_shapes(model, layer).items()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_layer_mapping_round_trip_is_bitwise(family):
    model = tiny_model_config(family)
    hf = _random_layer(model, 1)
    mcore = mapping.hf_layer_to_mcore(hf, model, 1)
    assert {k: tuple(v.shape) for k, v in mcore.items()} == mapping.mcore_layer_shapes(model)
    assert mapping.DENSE_MLP[0] not in mcore and set(mapping.MOE_SUFFIXES) <= mcore.keys()
    back = mapping.mcore_layer_to_hf(mcore, model, 1)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    for key, tensor in mcore.items():  # the per-tensor API used for pushing weights
        for name, part in mapping.mcore_to_hf_tensors(mapping.LAYER_PREFIX + key, tensor, model, 1):
            assert torch.equal(part, hf[name]), name


@pytest.mark.parametrize(
    "family, gate, up, down",
    [
        ("qwen3_moe", *(f"mlp.experts.{{e}}.{n}_proj" for n in ("gate", "up", "down"))),
        ("mixtral", *(f"block_sparse_moe.experts.{{e}}.{n}" for n in ("w1", "w3", "w2"))),
    ],
)
def test_expert_layout(family, gate, up, down):
    """fc1 of expert e is [gate_e; up_e] at index e of the expert axis, fc2 is down_e; the router
    is HF's gate (router) weight."""
    model = tiny_model_config(family)
    fe = model.expert_ffn_hidden_size
    hf = {n: torch.zeros(s) for n, s in mapping.hf_shapes(model, 0).items()}
    for e in range(model.num_experts):
        hf[f"model.layers.0.{gate.format(e=e)}.weight"].fill_(10 * e + 1)
        hf[f"model.layers.0.{up.format(e=e)}.weight"].fill_(10 * e + 2)
        hf[f"model.layers.0.{down.format(e=e)}.weight"].fill_(10 * e + 3)
    router = family_by_name(family).experts.router
    hf[f"model.layers.0.{router}"] = torch.arange(4.0)[:, None].expand(4, model.hidden_size)
    mcore = mapping.hf_layer_to_mcore(hf, model, 0)
    fc1, fc2 = mcore[mapping.EXPERTS_FC1], mcore[mapping.EXPERTS_FC2]
    for e in range(model.num_experts):
        assert fc1[e, :fe].eq(10 * e + 1).all() and fc1[e, fe:].eq(10 * e + 2).all()
        assert fc2[e].eq(10 * e + 3).all()
    assert mcore[mapping.ROUTER][:, 0].tolist() == [0, 1, 2, 3]


@pytest.fixture
def moe_dir(tmp_path) -> Path:
    return write_random_hf("qwen3_moe", tmp_path / "hf", tiny_model_config("qwen3_moe"))


def test_hf_to_mcore_reads_one_layer_and_writes_every_expert(moe_dir, tmp_path, monkeypatch):
    reads: list[list[str]] = []
    original = HFReader.read

    def spy(self, names):
        reads.append(list(names))
        return original(self, names)

    monkeypatch.setattr(HFReader, "read", spy)
    model = hf_to_mcore(moe_dir, tmp_path / "out", tp=2, ep=4, make_vocab_size_divisible_by=16)
    layers_per_read = [
        {n.split(".")[2] for n in names if n.startswith("model.layers.")} for names in reads
    ]
    assert [len(s) for s in layers_per_read] == [0] + [1] * model.num_layers
    meta = check_checkpoint(tmp_path / "out")
    assert tuple(meta[mapping.LAYER_PREFIX + mapping.EXPERTS_FC1].size) == (2, 4, 64, 64)
    assert tuple(meta[mapping.LAYER_PREFIX + mapping.EXPERTS_FC2].size) == (2, 4, 64, 32)
    assert tuple(meta[mapping.LAYER_PREFIX + mapping.ROUTER].size) == (2, 4, 64)
    assert mapping.LAYER_PREFIX + mapping.DENSE_MLP[0] not in meta


def _rewrite_config(hf_dir: Path, **changes) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(changes)
    for key, value in changes.items():
        if value is None:
            del cfg[key]
    (hf_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"norm_topk_prob": False}, r"norm_topk_prob=False .*moe_router_pre_softmax"),
        ({"norm_topk_prob": None}, r"norm_topk_prob=absent \(false\)"),
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2.*no moe_layer_freq"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\].*no moe_layer_freq"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 \(must be in \[1, 4\]\)"),
        ({"num_local_experts": 8}, r"\{'num_experts': 4, 'num_local_experts': 8\} disagree"),
        ({"num_experts": None}, r"lacks the expert count \(num_experts or num_local_experts\)"),
        ({"moe_intermediate_size": None}, r"lacks moe_intermediate_size"),
        ({"architectures": ["Qwen2MoeForCausalLM"]}, r"unsupported architecture.*Qwen2Moe"),
        ({"num_experts": 8}, r"missing tensors \['model.layers.0.mlp.experts.4.down_proj"),
        ({"moe_intermediate_size": 16}, r"experts.0.gate_proj.weight: shape \(32, 64\) != exp"),
    ],
)
def test_unrepresentable_qwen3_moe_config_is_refused(moe_dir, tmp_path, changes, message):
    _rewrite_config(moe_dir, **changes)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(moe_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"sliding_window": 4096}, r"sliding_window=4096 \(sliding-window attention"),
        ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 \(only 0"),
    ],
)
def test_unrepresentable_mixtral_config_is_refused(tmp_path, changes, message):
    hf_dir = write_random_hf("mixtral", tmp_path / "hf", tiny_model_config("mixtral"))
    _rewrite_config(hf_dir, **changes)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(hf_dir, tmp_path / "out")


def test_layout_the_experts_do_not_split_into_is_refused(moe_dir, tmp_path, capsys):
    with pytest.raises(ConversionError, match=r"ep=3.*num_experts \(4\) % ep \(3\) != 0"):
        hf_to_mcore(moe_dir, tmp_path / "out", ep=3)
    with pytest.raises(ConversionError, match=r"moe_ffn_hidden_size \(32\) % etp \(3\) != 0"):
        hf_to_mcore(moe_dir, tmp_path / "out", etp=3)
    args = ["hf-to-mcore", "--hf", str(moe_dir), "--out", str(tmp_path / "out")]
    assert convert_main([*args, "--ep", "3"]) == 2
    assert "num_experts (4) % ep (3)" in capsys.readouterr().err
    assert convert_main([*args, "--tp", "2", "--ep", "2", "--etp", "1"]) == 0


def test_checkpoint_with_another_expert_count_is_refused(moe_dir, tmp_path):
    hf_to_mcore(moe_dir, tmp_path / "mcore", make_vocab_size_divisible_by=16)
    _rewrite_config(moe_dir, num_experts=8)
    key = mapping.LAYER_PREFIX + mapping.ROUTER
    message = rf"{key}: checkpoint shape \(2, 4, 64\) != \(2, 8, 64\).*num_experts=8"
    with pytest.raises(ConversionError, match=message):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config_dir=moe_dir)
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size=64"),
        (
            {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
            "moe_router_score_function='sigmoid' .*moe_router_enable_expert_bias=true",
        ),
        ({"moe_expert_capacity_factor": 1.0}, r"moe_expert_capacity_factor=1.0 \(no token"),
    ],
)
def test_export_refuses_a_router_hf_does_not_compute(changes, message):
    model = dataclasses.replace(tiny_model_config("qwen3_moe"), **changes)
    with pytest.raises(ConversionError, match=message):
        hf_config_from_model(model, family_by_name("qwen3_moe"))


def test_export_refuses_experts_no_family_has():
    qkv_bias_moe = dataclasses.replace(tiny_model_config("qwen3_moe"), add_qkv_bias=True)
    with pytest.raises(ConversionError, match=r"qkv bias=True, qk norm=True and experts=True"):
        family_for_model(qkv_bias_moe)
    with pytest.raises(ConversionError, match=r"num_experts=4 cannot be expressed as Qwen3ForC"):
        hf_config_from_model(tiny_model_config("qwen3_moe"), family_by_name("qwen3"))
