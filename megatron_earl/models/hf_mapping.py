"""Megatron <-> Hugging Face names for one tensor at a time (weight push to SGLang, the server's
``update_weights_from_tensor``), on top of the one mapping table of ``convert.mapping``.

Megatron side: the *global* checkpoint keys of ``redistribute.geometry`` (layer-stacked: decoder
tensors carry a leading layer axis). HF side: ``model.layers.{i}....`` names of Llama / Qwen2 /
Qwen3. ``convert.mapping`` owns the layouts (grouped ``linear_qkv`` per KV group, ``linear_fc1`` =
``[gate ; up]``, vocabulary padding, tied embeddings); this module only adds the per-tensor
direction HF name -> (Megatron key, layer, rows) that a partial update needs (``global_shapes``
is ``convert.mapping``'s, re-exported here for its callers).

Pure functions of tensors; no communication.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert import mapping
from megatron_earl.convert.mapping import global_shapes

_GLOBAL = {
    mapping.HF_EMBEDDING: mapping.EMBEDDING,
    mapping.HF_FINAL_NORM: mapping.FINAL_NORM,
    mapping.HF_OUTPUT: mapping.OUTPUT,
}
_VOCAB_KEYS = (mapping.EMBEDDING, mapping.OUTPUT)
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
    """Row indices of q, k and v inside the grouped ``linear_qkv`` (per layer), derived by
    grouping row ids with the converter's own ``group_qkv``."""
    n, g = model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    ids = torch.arange(n + 2 * g)
    placed = mapping.group_qkv(ids[:n], ids[n : n + g], ids[n + g :], model)
    where = torch.argsort(placed)  # where[i] = row of the grouped tensor holding source row i
    return {"q": where[:n], "k": where[n : n + g], "v": where[n + g :]}


def hf_target(hf_name: str, model: ModelConfig) -> HFTarget:
    """The Megatron location of an HF tensor name; ``KeyError`` names an unknown name."""
    if hf_name in _GLOBAL and not (hf_name == mapping.HF_OUTPUT and model.tie_embeddings):
        key = _GLOBAL[hf_name]
        return HFTarget(key, None, torch.arange(model.vocab_size) if key in _VOCAB_KEYS else None)
    match = _HF_LAYER.match(hf_name)
    if match and int(match.group(1)) < model.num_layers:
        layer, rel = int(match.group(1)), match.group(2)
        table = dict(mapping.LAYER_TABLE)
        for suffix in mapping.layer_suffixes(model):
            names = table[suffix]
            if rel not in names:
                continue
            key = mapping.LAYER_PREFIX + suffix
            if len(names) == 3:
                return HFTarget(key, layer, qkv_rows(model)["qkv"[names.index(rel)]])
            if len(names) == 2:
                f = model.ffn_hidden_size
                start = f * names.index(rel)
                return HFTarget(key, layer, torch.arange(start, start + f))
            return HFTarget(key, layer, None)
    raise KeyError(f"{hf_name!r} is not an HF Llama/Qwen tensor name of this model")


def megatron_to_hf(
    key: str, tensor: torch.Tensor, model: ModelConfig, first_layer: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one global Megatron tensor (layer-stacked for decoder keys:
    its layers ``first_layer, first_layer + 1, ...``; a slice of the stack when not 0)."""
    if key == mapping.OUTPUT and model.tie_embeddings:
        return
    if not key.startswith(mapping.LAYER_PREFIX):
        yield from mapping.mcore_to_hf_tensors(key, tensor, model)
        return
    for i in range(tensor.size(0)):
        yield from mapping.mcore_to_hf_tensors(key, tensor[i], model, first_layer + i)


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
    rows = dst.shape[0] if target.rows is None else len(target.rows)
    view_shape = (rows, *dst.shape[1:])
    if tuple(tensor.shape) != view_shape:
        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {view_shape}")
    if target.rows is None:
        dst.copy_(tensor)
    else:
        dst[target.rows] = tensor.to(dst.dtype)
    return target.key


def read_name(hf_name: str, model: ModelConfig) -> str:
    """The HF name whose tensor SGLang answers for ``hf_name`` (a tied ``lm_head.weight``: the
    embedding's)."""
    tied_head = hf_name == mapping.HF_OUTPUT and model.tie_embeddings
    return mapping.HF_EMBEDDING if tied_head else hf_name


def hf_tensor(full: Mapping[str, torch.Tensor], hf_name: str, model: ModelConfig) -> torch.Tensor:
    """The HF tensor ``hf_name`` read from a full Megatron state (the inverse of
    ``apply_hf_tensor``; a view where no rows are selected). A tied ``lm_head.weight`` reads the
    embedding, as SGLang's ``get_weights_by_name`` answers it. ``KeyError`` names an unknown
    name."""
    target = hf_target(read_name(hf_name, model), model)
    if target.key not in full:
        raise KeyError(f"{hf_name!r} maps to {target.key!r}, which this model does not have")
    src = full[target.key] if target.layer is None else full[target.key][target.layer]
    return src if target.rows is None else src[target.rows]


def hf_to_megatron(hf: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """A full Megatron state from a complete HF state dict (padding rows zero)."""
    first = next(iter(hf.values()))
    full = {k: torch.zeros(s, dtype=first.dtype) for k, s in global_shapes(model).items()}
    for name, tensor in hf.items():
        apply_hf_tensor(full, name, tensor, model)
    return full
