"""Megatron <-> Hugging Face (Llama / Qwen2 / Qwen3) tensor names and layouts.

Megatron side: the *global* checkpoint keys of ``redistribute.geometry`` (layer-stacked: the
decoder tensors carry a leading layer axis, the TE-style names Megatron's ``sharded_state_dict``
uses on both the local and the TE spec). HF side: ``model.layers.{i}....`` names of
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (what SGLang loads).

Layouts that are not a rename:
* ``linear_qkv`` is grouped per KV group: rows ``[q heads of group g ; k_g ; v_g]`` for each group
  g (bias the same); HF has separate ``q_proj``/``k_proj``/``v_proj``.
* ``linear_fc1`` (SwiGLU) is ``[gate ; up]``; HF has ``gate_proj`` / ``up_proj``.
* Embedding and output layer are padded to ``padded_vocab_size`` rows in Megatron; HF gets the
  first ``vocab_size`` rows (and padding rows are zero when converting HF -> Megatron).
* Tied embeddings: no ``lm_head.weight`` / ``output_layer.weight``.

Pure functions of tensors; no communication. Used by the SGLang weight push and the server's
``update_weights_from_tensor``, and by checkpoint conversion.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from megatron_earl.config.model import ModelConfig

_LAYER = "decoder.layers."
# Megatron per-layer suffix -> HF per-layer suffix, for the plain renames.
_RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class HFTarget:
    """Where one HF tensor lives in the Megatron global state."""

    key: str
    """Global (layer-stacked) Megatron key."""
    layer: int | None
    """Index along the layer axis (None for non-decoder tensors)."""
    rows: torch.Tensor | None
    """Row indices (dim 0 of the per-layer tensor) the HF tensor fills; None = all rows."""


def qkv_rows(model: ModelConfig) -> dict[str, torch.Tensor]:
    """Row indices of q, k and v inside the grouped ``linear_qkv`` (per layer)."""
    d, groups = model.head_dim, model.query_groups
    per_group = model.num_attention_heads // groups
    block = (per_group + 2) * d
    base = torch.arange(groups)[:, None] * block
    q = (base + torch.arange(per_group * d)[None]).reshape(-1)
    k = (base + per_group * d + torch.arange(d)[None]).reshape(-1)
    v = (base + (per_group + 1) * d + torch.arange(d)[None]).reshape(-1)
    return {"q": q, "k": k, "v": v}


def hf_target(hf_name: str, model: ModelConfig) -> HFTarget:
    """The Megatron location of an HF tensor name; ``KeyError`` names an unknown name."""
    for key, name in _GLOBAL.items():
        if hf_name == name:
            if key == "output_layer.weight" and model.tie_embeddings:
                break
            rows = torch.arange(model.vocab_size) if key in _VOCAB_KEYS else None
            return HFTarget(key, None, rows)
    match = _HF_LAYER.match(hf_name)
    if match and int(match.group(1)) < model.num_layers:
        layer, suffix = int(match.group(1)), match.group(2)
        for meg, hf in _RENAMES.items():
            if suffix == hf:
                return HFTarget(_LAYER + meg, layer, None)
        proj = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", suffix)
        if proj:
            return HFTarget(
                f"{_LAYER}self_attention.linear_qkv.{proj.group(2)}",
                layer,
                qkv_rows(model)[proj.group(1)],
            )
        mlp = re.match(r"^mlp\.(gate|up)_proj\.weight$", suffix)
        if mlp:
            f = model.ffn_hidden_size
            start = 0 if mlp.group(1) == "gate" else f
            return HFTarget(f"{_LAYER}mlp.linear_fc1.weight", layer, torch.arange(start, start + f))
    raise KeyError(f"{hf_name!r} is not an HF Llama/Qwen tensor name of this model")


def megatron_to_hf(
    key: str, tensor: torch.Tensor, model: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one global Megatron tensor (layer-stacked for decoder keys)."""
    if key in _GLOBAL:
        if key == "output_layer.weight" and model.tie_embeddings:
            return
        yield _GLOBAL[key], tensor[: model.vocab_size] if key in _VOCAB_KEYS else tensor
        return
    if not key.startswith(_LAYER):
        raise KeyError(f"{key!r} is not a Megatron GPT key this mapping knows")
    suffix = key[len(_LAYER) :]
    for layer in range(tensor.size(0)):
        prefix = f"model.layers.{layer}."
        per_layer = tensor[layer]
        if suffix in _RENAMES:
            yield prefix + _RENAMES[suffix], per_layer
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            for name, rows in qkv_rows(model).items():
                yield f"{prefix}self_attn.{name}_proj.{kind}", per_layer[rows]
        elif suffix == "mlp.linear_fc1.weight":
            f = model.ffn_hidden_size
            yield prefix + "mlp.gate_proj.weight", per_layer[:f]
            yield prefix + "mlp.up_proj.weight", per_layer[f:]
        else:
            raise KeyError(f"{key!r} is not a Megatron GPT key this mapping knows")


def full_megatron_to_hf(
    full: Mapping[str, torch.Tensor], model: ModelConfig
) -> dict[str, torch.Tensor]:
    """Every HF tensor of a full Megatron state (``geometry.full_state_dict``)."""
    return {
        name: t for key, tensor in full.items() for name, t in megatron_to_hf(key, tensor, model)
    }


@torch.no_grad()
def apply_hf_tensor(
    full: dict[str, torch.Tensor], hf_name: str, tensor: torch.Tensor, model: ModelConfig
) -> str:
    """Write one HF tensor into a full Megatron state in place; returns the Megatron key."""
    target = hf_target(hf_name, model)
    if target.key not in full:
        raise KeyError(f"{hf_name!r} maps to {target.key!r}, which this model does not have")
    dst = full[target.key] if target.layer is None else full[target.key][target.layer]
    if target.rows is None:
        view_shape = tuple(dst.shape)
    else:
        view_shape = (len(target.rows), *dst.shape[1:])
    if tuple(tensor.shape) != view_shape:
        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {view_shape}")
    if target.rows is None:
        dst.copy_(tensor)
    else:
        dst[target.rows] = tensor.to(dst.dtype)
    return target.key


def hf_to_megatron(hf: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """A full Megatron state from a complete HF state dict (padding rows zero)."""
    shapes = _global_shapes(model)
    first = next(iter(hf.values()))
    full = {k: torch.zeros(s, dtype=first.dtype) for k, s in shapes.items()}
    for name, tensor in hf.items():
        apply_hf_tensor(full, name, tensor, model)
    return full


def _global_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f, L = model.hidden_size, model.ffn_hidden_size, model.num_layers
    d, heads, groups = model.head_dim, model.num_attention_heads, model.query_groups
    qkv = (heads + 2 * groups) * d
    shapes = {
        "embedding.word_embeddings.weight": (model.padded_vocab_size, h),
        f"{_LAYER}self_attention.linear_qkv.layer_norm_weight": (L, h),
        f"{_LAYER}self_attention.linear_qkv.weight": (L, qkv, h),
        f"{_LAYER}self_attention.linear_proj.weight": (L, h, heads * d),
        f"{_LAYER}mlp.linear_fc1.layer_norm_weight": (L, h),
        f"{_LAYER}mlp.linear_fc1.weight": (L, 2 * f, h),
        f"{_LAYER}mlp.linear_fc2.weight": (L, h, f),
        "decoder.final_layernorm.weight": (h,),
    }
    if model.add_qkv_bias:
        shapes[f"{_LAYER}self_attention.linear_qkv.bias"] = (L, qkv)
    if model.qk_layernorm:
        shapes[f"{_LAYER}self_attention.q_layernorm.weight"] = (L, d)
        shapes[f"{_LAYER}self_attention.k_layernorm.weight"] = (L, d)
    if not model.tie_embeddings:
        shapes["output_layer.weight"] = (model.padded_vocab_size, h)
    return shapes
