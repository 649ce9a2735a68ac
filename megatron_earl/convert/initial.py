"""Initial weights for training: an HF directory or a Megatron checkpoint, detected by content.

    load_initial_weights(model_chunks, "hf/Qwen2.5-0.5B")       # HF: converted on the fly
    load_initial_weights(model_chunks, "runs/sft/checkpoints")  # Megatron: resolves 'latest'

HF: every rank reads only the layers its pipeline stage holds, one layer at a time, converts them
with ``convert.mapping`` and copies its own shards (``redistribute.geometry.shard_pieces``); no
communication, no full model in memory. Megatron: ``dist_checkpointing.load`` of the chunks'
sharded state dict (reshards from whatever layout it was saved in). Call it before building the
optimizer (which copies the parameters into its own main parameters in mixed precision).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from megatron_earl.config.model import ModelConfig
from megatron_earl.convert import mapping
from megatron_earl.convert.families import ConversionError, model_config_from_hf, read_hf_config
from megatron_earl.convert.hf_io import HFReader


def is_hf_dir(path: str | Path) -> bool:
    """True for an HF model directory (``config.json`` next to safetensors weights)."""
    p = Path(path)
    has_weights = (p / "model.safetensors").is_file() or (
        p / "model.safetensors.index.json"
    ).is_file()
    return (p / "config.json").is_file() and has_weights


def load_initial_weights(
    model_chunks: list[nn.Module], path: str | Path, model_config: ModelConfig | None = None
) -> str:
    """Load ``path`` into this rank's chunks; returns "hf" or "mcore" (what was detected).
    ``model_config`` (the run's ``ModelConfig``): a Megatron checkpoint's ``args`` are checked
    against it, so a padding or shape difference names both values and the keys that fix it.

    Which ranks call: every rank of the world (a Megatron checkpoint load is collective; the HF
    path is local but every rank must load its own shards).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"initial checkpoint {p} does not exist")
    if is_hf_dir(p):
        load_hf_weights(model_chunks, p)
        return "hf"
    from megatron_earl.training.checkpoint import load_model_weights, resolve_checkpoint

    load_model_weights(model_chunks, resolve_checkpoint(p), model_config)
    return "mcore"


@torch.no_grad()
def load_hf_weights(model_chunks: list[nn.Module], hf_dir: str | Path) -> None:
    """Copy this rank's shards out of an HF directory, one layer at a time. Local."""
    from megatron_earl.redistribute.geometry import region_slices, shard_pieces

    pieces = shard_pieces(model_chunks)
    model = _model_for(read_hf_config(hf_dir), pieces)
    reader = HFReader(hf_dir)
    by_layer: dict[int | None, list] = defaultdict(list)
    for piece in pieces:
        if piece.key.startswith(mapping.LAYER_PREFIX):
            (start, stop) = piece.region[0]
            assert stop == start + 1, (piece.key, piece.region)  # one layer per piece
            by_layer[start].append(piece)
        else:
            by_layer[None].append(piece)
    shapes = mapping.global_shapes(model)
    for layer, layer_pieces in sorted(
        by_layer.items(), key=lambda kv: -1 if kv[0] is None else kv[0]
    ):
        if layer is None:
            full = _top_tensors(reader, model)
        else:
            hf = reader.read(mapping.hf_layer_names(model, layer))
            slices = mapping.hf_layer_to_mcore(hf, model, layer)
            full = {mapping.LAYER_PREFIX + s: t.unsqueeze(0) for s, t in slices.items()}
        for piece in layer_pieces:
            if piece.key not in full:
                raise ConversionError(f"model tensor {piece.key} has no HF counterpart")
            src = full[piece.key]
            region = piece.region
            if layer is not None:
                expected = shapes[piece.key]
                region = ((0, 1), *region[1:])
            else:
                expected = tuple(src.shape)
            if tuple(piece.global_shape) != expected:
                raise ConversionError(
                    f"model tensor {piece.key}: shape {piece.global_shape} != {expected} from "
                    f"{hf_dir}/config.json"
                )
            piece.local.copy_(src[region_slices(region)].reshape(piece.local.shape))


def _model_for(cfg: dict, pieces) -> ModelConfig:
    """The HF config as a ModelConfig whose padded vocabulary matches the model being loaded."""
    model = model_config_from_hf(cfg)
    rows = next((p.global_shape[0] for p in pieces if p.key == mapping.EMBEDDING), None)
    rows = rows or next((p.global_shape[0] for p in pieces if p.key == mapping.OUTPUT), None)
    if rows is not None and rows != model.padded_vocab_size:
        if rows < model.vocab_size:
            raise ConversionError(
                f"model vocabulary ({rows} rows) is smaller than the HF vocab_size "
                f"({model.vocab_size})"
            )
        model = dataclasses.replace(model, make_vocab_size_divisible_by=rows)
    return model


def _top_tensors(reader: HFReader, model: ModelConfig) -> dict[str, torch.Tensor]:
    out = mapping.hf_top_to_mcore(reader.read(mapping.hf_top_names(model)), model)
    out.setdefault(mapping.OUTPUT, out[mapping.EMBEDDING])  # tied: the output layer reads it
    return out
