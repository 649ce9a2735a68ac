"""Tiny random HF models of each family, built offline (tests, benchmarks, examples).

    path = save_tiny_hf("qwen3", "/tmp/tiny-qwen3", num_layers=2, tie=False)
    path = save_tiny_hf("qwen3_moe", "/tmp/tiny-qwen3-moe")   # Qwen3MoeForCausalLM, 4 experts

``tiny_hf_model`` builds the model with ``transformers``' own class of the family (e.g.
``Qwen3MoeConfig`` / ``Qwen3MoeForCausalLM``) from a config (no download) and randomises *every*
parameter, norms, biases, routers and experts included (HF initialises biases to zero and norms to
one, which would leave their mapping untested). ``write_random_hf`` writes an HF directory of
random tensors without ``transformers`` and one layer at a time (for the memory benchmark, whose
models are larger).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert import mapping
from megatron_earl.convert.families import family_by_name, hf_config_from_model

TINY_SHAPES: dict[str, dict[str, Any]] = {
    # GQA, untied; head_dim = hidden / heads.
    "llama": dict(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2),
    # QKV bias, tied embeddings, multi-head.
    "qwen2": dict(hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=4),
    # q/k norm, GQA, head_dim (16) != hidden / heads (8).
    "qwen3": dict(
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
    ),
    # q/k norm, GQA, head_dim (32) != hidden / heads (16); each layer a mixture: 4 experts of
    # width 32, top-2 (HF's dense intermediate_size 128 is carried along, unused)
    "qwen3_moe": dict(
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
    ),
    # Llama attention (GQA), 4 experts of width 48 (Mixtral's intermediate_size), top-2
    "mixtral": dict(
        hidden_size=64,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_query_groups=2,
        num_experts=4,
        moe_router_topk=2,
    ),
}


TINY_ROPE: dict[str, dict[str, Any]] = {
    # Original contexts of 8 positions, so a 12-token test sequence runs past them.
    "default": {},
    "linear": dict(rope_type="linear", rope_scaling_factor=4.0),
    "llama3": dict(
        rope_type="llama3",
        rope_scaling_factor=8.0,
        rope_original_max_position_embeddings=8,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
    ),
    "yarn": dict(
        rope_type="yarn", rope_scaling_factor=16.0, rope_original_max_position_embeddings=8
    ),
}
"""RoPE variants of the tiny models (``ModelConfig`` fields; max_position_embeddings is 128)."""


def tiny_model_config(
    family: str,
    *,
    num_layers: int = 2,
    tie: bool = False,
    vocab_size: int = 100,
    rope: str = "default",
) -> ModelConfig:
    fam = family_by_name(family)
    return ModelConfig(
        num_layers=num_layers,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=16,
        tie_embeddings=tie,
        add_qkv_bias=fam.qkv_bias,
        qk_layernorm=fam.qk_norm,
        rotary_base=10000.0,
        max_position_embeddings=128,
        **TINY_SHAPES[family],
        **TINY_ROPE[rope],
    )


def tiny_hf_model(family: str, *, seed: int = 0, std: float = 0.2, **kwargs):
    """A ``transformers`` model of ``family`` with every parameter random (fp32, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = tiny_model_config(family, **kwargs)
    cfg_dict = hf_config_from_model(model_config, family_by_name(family))
    cfg_dict["dtype"] = "float32"
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return model


def save_tiny_hf(family: str, path: str | Path, *, max_shard_size: str = "20KB", **kwargs) -> Path:
    """Save a ``tiny_hf_model`` (sharded safetensors + index) to ``path``."""
    model = tiny_hf_model(family, **kwargs)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return Path(path)


def write_random_hf(family: str, path: str | Path, model: ModelConfig, seed: int = 0) -> Path:
    """Write an HF directory of random fp32 tensors for ``model``, one shard per layer."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    top = {
        mapping.HF_EMBEDDING: (model.vocab_size, model.hidden_size),
        mapping.HF_FINAL_NORM: (model.hidden_size,),
    }
    if not model.tie_embeddings:
        top[mapping.HF_OUTPUT] = (model.vocab_size, model.hidden_size)
    groups = [top] + [mapping.hf_shapes(model, layer) for layer in range(model.num_layers)]
    for i, shapes in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: 0.02 * torch.randn(s, generator=gen) for n, s in shapes.items()}
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update((n, file) for n in tensors)
        del tensors
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = hf_config_from_model(model, family_by_name(family))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
