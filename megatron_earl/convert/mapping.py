"""HF tensor names/layouts <-> Megatron global tensors, one layer at a time (pure torch).

Megatron global keys are the checkpoint keys of ``redistribute/geometry.py``: layer keys are
layer-stacked (``decoder.layers.<suffix>`` with a leading layer axis); here a *layer slice* is one
layer's tensor without that axis. Both the local/SDPA spec and the Transformer Engine spec save the
same keys (the local spec maps ``input_layernorm`` to ``linear_qkv.layer_norm_weight`` and
``pre_mlp_layernorm`` to ``linear_fc1.layer_norm_weight`` in its ``sharded_state_dict``), so one
table serves both.

Layouts (h = hidden, d = head dim, n = query heads, g = KV groups, f = FFN width, V/Vp = vocab
unpadded/padded):

- ``linear_qkv.weight`` [(n + 2g) d, h]: per KV group i, rows ``[q heads of group i; k_i; v_i]``
  (bias the same, 1-D). Plain ``[Q; K; V]`` concatenation is wrong.
- ``linear_fc1.weight`` [2f, h] = ``[gate_proj; up_proj]``.
- embeddings / output layer [Vp, h]: HF rows, then ``Vp - V`` zero rows (dropped on the way back).

Every HF tensor's shape is checked against the config; a mismatch names the tensor, both shapes
and the config values that imply the expected one.
"""

from __future__ import annotations

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert.families import ConversionError

LAYER_PREFIX = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"

HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_OUTPUT = "lm_head.weight"

# Megatron layer suffix -> HF layer-relative names, in concatenation order.
LAYER_TABLE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    (
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    ("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",)),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
)

# Modules with a (None-valued, for the local spec) ``_extra_state`` ShardedObject per layer.
EXTRA_STATE_SUFFIXES = (
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv._extra_state",
    "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2._extra_state",
)


def layer_suffixes(model: ModelConfig) -> list[str]:
    """Megatron layer-key suffixes this model has (``decoder.layers.`` + suffix is the key)."""
    out = []
    for suffix, _ in LAYER_TABLE:
        if suffix.endswith("linear_qkv.bias") and not model.add_qkv_bias:
            continue
        if "q_layernorm" in suffix or "k_layernorm" in suffix:
            if not model.qk_layernorm:
                continue
        out.append(suffix)
    return out


def hf_layer_names(model: ModelConfig, layer: int) -> list[str]:
    """Full HF names of layer ``layer``'s tensors."""
    table = dict(LAYER_TABLE)
    return [f"model.layers.{layer}.{n}" for s in layer_suffixes(model) for n in table[s]]


def hf_shapes(model: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor of layer ``layer``."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    n, g = model.num_attention_heads, model.query_groups
    rel = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (n * d, h),
        "self_attn.k_proj.weight": (g * d, h),
        "self_attn.v_proj.weight": (g * d, h),
        "self_attn.q_proj.bias": (n * d,),
        "self_attn.k_proj.bias": (g * d,),
        "self_attn.v_proj.bias": (g * d,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, n * d),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    prefix = f"model.layers.{layer}."
    return {name: rel[name[len(prefix) :]] for name in hf_layer_names(model, layer)}


def _describe(model: ModelConfig) -> str:
    return (
        f"hidden_size={model.hidden_size}, intermediate_size={model.ffn_hidden_size}, "
        f"num_attention_heads={model.num_attention_heads}, "
        f"num_key_value_heads={model.query_groups}, head_dim={model.head_dim}, "
        f"vocab_size={model.vocab_size}"
    )


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], model: ModelConfig):
    if tuple(tensor.shape) != tuple(expected):
        raise ConversionError(
            f"tensor {name}: shape {tuple(tensor.shape)} != expected {tuple(expected)} "
            f"from the config ({_describe(model)})"
        )


def group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig):
    g, per = model.query_groups, model.num_attention_heads // model.query_groups
    d = model.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def ungroup_qkv(qkv: torch.Tensor, model: ModelConfig):
    g, per = model.query_groups, model.num_attention_heads // model.query_groups
    d = model.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (t.reshape(-1, *tail).contiguous() for t in (q, k, v))


def hf_top_names(model: ModelConfig) -> list[str]:
    """HF names of the tensors outside the layers (no ``lm_head`` when embeddings are tied)."""
    return [HF_EMBEDDING, HF_FINAL_NORM] + ([] if model.tie_embeddings else [HF_OUTPUT])


def hf_top_to_mcore(hf: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Megatron embedding, final norm and (untied) output layer from the ``hf_top_names``
    tensors; vocabulary rows padded."""
    check_shape(HF_FINAL_NORM, hf[HF_FINAL_NORM], (model.hidden_size,), model)
    out = {
        EMBEDDING: pad_vocab(HF_EMBEDDING, hf[HF_EMBEDDING], model),
        FINAL_NORM: hf[HF_FINAL_NORM],
    }
    if not model.tie_embeddings:
        out[OUTPUT] = pad_vocab(HF_OUTPUT, hf[HF_OUTPUT], model)
    return out


def hf_layer_to_mcore(
    hf: dict[str, torch.Tensor], model: ModelConfig, layer: int
) -> dict[str, torch.Tensor]:
    """Megatron layer slices (key suffix -> tensor) from layer ``layer``'s HF tensors."""
    shapes = hf_shapes(model, layer)
    for name, shape in shapes.items():
        if name not in hf:
            raise ConversionError(f"tensor {name} is missing from the HF checkpoint")
        check_shape(name, hf[name], shape, model)
    table = dict(LAYER_TABLE)
    prefix = f"model.layers.{layer}."
    out = {}
    for suffix in layer_suffixes(model):
        parts = [hf[prefix + n] for n in table[suffix]]
        if suffix.startswith("self_attention.linear_qkv.") and len(parts) == 3:
            out[suffix] = group_qkv(*parts, model)
        elif len(parts) == 2:
            out[suffix] = torch.cat(parts, dim=0)
        else:
            out[suffix] = parts[0]
    return out


def mcore_layer_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every Megatron layer slice (no layer axis)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    n, g = model.num_attention_heads, model.query_groups
    qkv = (n + 2 * g) * d
    shapes = {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (qkv, h),
        "self_attention.linear_qkv.bias": (qkv,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, n * d),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * f, h),
        "mlp.linear_fc2.weight": (h, f),
    }
    return {s: shapes[s] for s in layer_suffixes(model)}


def global_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every Megatron global tensor (layer keys stacked over ``num_layers``)."""
    vocab = (model.padded_vocab_size, model.hidden_size)
    shapes = {
        LAYER_PREFIX + suffix: (model.num_layers, *shape)
        for suffix, shape in mcore_layer_shapes(model).items()
    }
    shapes[EMBEDDING] = vocab
    shapes[FINAL_NORM] = (model.hidden_size,)
    if not model.tie_embeddings:
        shapes[OUTPUT] = vocab
    return shapes


def mcore_layer_to_hf(
    mcore: dict[str, torch.Tensor], model: ModelConfig, layer: int
) -> dict[str, torch.Tensor]:
    """HF tensors of layer ``layer`` from its Megatron layer slices (key suffix -> tensor)."""
    out = {}
    for suffix, shape in mcore_layer_shapes(model).items():
        key = LAYER_PREFIX + suffix
        if suffix not in mcore:
            raise ConversionError(f"tensor {key} (layer {layer}) is missing from the checkpoint")
        check_shape(f"{key}[layer {layer}]", mcore[suffix], shape, model)
        out.update(_single_layer_to_hf(suffix, mcore[suffix], model, layer))
    return out


def pad_vocab(name: str, tensor: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """HF embedding/lm_head [V, h] -> Megatron [Vp, h] (zero rows appended)."""
    check_shape(name, tensor, (model.vocab_size, model.hidden_size), model)
    extra = model.padded_vocab_size - model.vocab_size
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, tensor.shape[1])], dim=0)


def unpad_vocab(key: str, tensor: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Megatron embedding/output [Vp, h] -> HF [V, h]."""
    check_shape(key, tensor, (model.padded_vocab_size, model.hidden_size), model)
    return tensor[: model.vocab_size].contiguous()


def mcore_to_hf_tensors(
    key: str, tensor: torch.Tensor, model: ModelConfig, layer: int | None = None
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one Megatron global tensor (a layer slice when ``key`` is a
    layer key; ``layer`` then says which). For pushing weights to HF-named engines, e.g. SGLang."""
    if key.startswith(LAYER_PREFIX):
        if layer is None:
            raise ValueError(f"{key} is a layer key: pass the layer index")
        table = dict(LAYER_TABLE)
        suffix = key[len(LAYER_PREFIX) :]
        if suffix not in table:
            raise ConversionError(f"no HF name for Megatron tensor {key}")
        sub = _single_layer_to_hf(suffix, tensor, model, layer)
        return list(sub.items())
    if key == EMBEDDING:
        return [(HF_EMBEDDING, unpad_vocab(key, tensor, model))]
    if key == OUTPUT:
        return [(HF_OUTPUT, unpad_vocab(key, tensor, model))]
    if key == FINAL_NORM:
        return [(HF_FINAL_NORM, tensor)]
    raise ConversionError(f"no HF name for Megatron tensor {key}")


def _single_layer_to_hf(suffix: str, tensor: torch.Tensor, model: ModelConfig, layer: int):
    names = [f"model.layers.{layer}.{n}" for n in dict(LAYER_TABLE)[suffix]]
    if len(names) == 3:
        parts = tuple(ungroup_qkv(tensor, model))
    elif len(names) == 2:
        parts = torch.chunk(tensor, 2, dim=0)
    else:
        parts = (tensor,)
    return {n: p.contiguous() for n, p in zip(names, parts, strict=True)}
