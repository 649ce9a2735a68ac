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
- Mixture of experts (E experts of width fe; HF names per family, ``families.ExpertNames``): the
  router ``mlp.router.weight`` [E, h] is HF's gate (router) weight; megatron-core's
  ``SequentialMLP`` saves its experts stacked on an expert axis after the layer axis:
  ``mlp.experts.experts.linear_fc1.weight`` [E, 2fe, h] with expert e's rows ``[gate_e; up_e]``
  (the SwiGLU layout of a dense fc1) and ``mlp.experts.experts.linear_fc2.weight`` [E, h, fe] =
  ``down_e``. They replace ``mlp.linear_fc1.weight`` / ``linear_fc2.weight``; the
  pre-MLP norm keeps its key ``mlp.linear_fc1.layer_norm_weight``.

Every HF tensor's shape is checked against the config; a mismatch names the tensor, both shapes
and the config values that imply the expected one.
"""

from __future__ import annotations

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert.families import ConversionError, ExpertNames, family_for_model

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

DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
ROUTER = "mlp.router.weight"
EXPERTS_FC1 = "mlp.experts.experts.linear_fc1.weight"
EXPERTS_FC2 = "mlp.experts.experts.linear_fc2.weight"
MOE_SUFFIXES = (ROUTER, EXPERTS_FC1, EXPERTS_FC2)
"""A mixture of experts' layer keys (in place of ``DENSE_MLP``)."""

# Modules with a (None-valued, for the local spec) ``_extra_state`` ShardedObject per layer, and
# per expert of a layer.
_LAYER_EXTRA_STATES = (
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv._extra_state",
)
_DENSE_EXTRA_STATES = ("mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state")
_EXPERT_EXTRA_STATES = (
    "mlp.experts.experts.linear_fc1._extra_state",
    "mlp.experts.experts.linear_fc2._extra_state",
)


def extra_state_keys(model: ModelConfig, layer: int) -> list[str]:
    """Unique keys of layer ``layer``'s ``_extra_state`` ShardedObjects, as megatron-core names
    them: ``<key>/shard_<offsets>_<shape>`` over the layer axis, and for an expert's linears over
    (layer, expert)."""
    num_layers = model.num_layers
    keys = [f"{LAYER_PREFIX}{s}/shard_{layer}_{num_layers}" for s in _LAYER_EXTRA_STATES]
    if not model.is_moe:
        keys += [f"{LAYER_PREFIX}{s}/shard_{layer}_{num_layers}" for s in _DENSE_EXTRA_STATES]
        return keys
    num_experts = model.num_experts
    for s in _EXPERT_EXTRA_STATES:
        keys += [
            f"{LAYER_PREFIX}{s}/shard_{layer}.{e}_{num_layers}.{num_experts}"
            for e in range(num_experts)
        ]
    return keys


def layer_suffixes(model: ModelConfig) -> list[str]:
    """Megatron layer-key suffixes this model has (``decoder.layers.`` + suffix is the key)."""
    out = []
    for suffix, _ in LAYER_TABLE:
        if suffix.endswith("linear_qkv.bias") and not model.add_qkv_bias:
            continue
        if "q_layernorm" in suffix or "k_layernorm" in suffix:
            if not model.qk_layernorm:
                continue
        if suffix in DENSE_MLP and model.is_moe:
            continue
        out.append(suffix)
    return out + (list(MOE_SUFFIXES) if model.is_moe else [])


def _experts(model: ModelConfig) -> ExpertNames:
    names = family_for_model(model).experts
    assert names is not None, model  # family_for_model matched an MoE model to an MoE family
    return names


def _hf_names(suffix: str, model: ModelConfig) -> tuple[str, ...]:
    """HF layer-relative names of one Megatron layer key, in concatenation order (an expert
    key: expert 0's names, then expert 1's, ...)."""
    if suffix not in MOE_SUFFIXES:
        return dict(LAYER_TABLE)[suffix]
    names = _experts(model)
    if suffix == ROUTER:
        return (names.router,)
    per_expert = (names.gate, names.up) if suffix == EXPERTS_FC1 else (names.down,)
    return tuple(n.format(e=e) for e in range(model.num_experts) for n in per_expert)


def hf_layer_names(model: ModelConfig, layer: int) -> list[str]:
    """Full HF names of layer ``layer``'s tensors."""
    return [f"model.layers.{layer}.{n}" for s in layer_suffixes(model) for n in _hf_names(s, model)]


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
    if model.is_moe:
        fe, names = model.expert_ffn_hidden_size, _experts(model)
        rel[names.router] = (model.num_experts, h)
        for e in range(model.num_experts):
            rel[names.gate.format(e=e)] = (fe, h)
            rel[names.up.format(e=e)] = (fe, h)
            rel[names.down.format(e=e)] = (h, fe)
    prefix = f"model.layers.{layer}."
    return {name: rel[name[len(prefix) :]] for name in hf_layer_names(model, layer)}


def _describe(model: ModelConfig) -> str:
    experts = (
        f"num_experts={model.num_experts}, expert ffn={model.expert_ffn_hidden_size}, "
        if model.is_moe
        else ""
    )
    return (
        f"hidden_size={model.hidden_size}, intermediate_size={model.ffn_hidden_size}, {experts}"
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
    prefix = f"model.layers.{layer}."
    out = {}
    for suffix in layer_suffixes(model):
        parts = [hf[prefix + n] for n in _hf_names(suffix, model)]
        if suffix == EXPERTS_FC1:  # [gate_e; up_e] per expert, stacked
            out[suffix] = torch.stack(
                [torch.cat(parts[i : i + 2]) for i in range(0, len(parts), 2)]
            )
        elif suffix == EXPERTS_FC2:
            out[suffix] = torch.stack(parts)
        elif suffix.startswith("self_attention.linear_qkv.") and len(parts) == 3:
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
    if model.is_moe:
        fe, num_experts = model.expert_ffn_hidden_size, model.num_experts
        shapes[ROUTER] = (num_experts, h)
        shapes[EXPERTS_FC1] = (num_experts, 2 * fe, h)
        shapes[EXPERTS_FC2] = (num_experts, h, fe)
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
        suffix = key[len(LAYER_PREFIX) :]
        if suffix not in layer_suffixes(model):
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
    names = [f"model.layers.{layer}.{n}" for n in _hf_names(suffix, model)]
    if suffix == EXPERTS_FC1:
        parts = tuple(half for expert in tensor for half in torch.chunk(expert, 2, dim=0))
    elif suffix == EXPERTS_FC2:
        parts = tuple(tensor)
    elif len(names) == 3:
        parts = tuple(ungroup_qkv(tensor, model))
    elif len(names) == 2:
        parts = torch.chunk(tensor, 2, dim=0)
    else:
        parts = (tensor,)
    return {n: p.contiguous() for n, p in zip(names, parts, strict=True)}
