"""HF -> Megatron ``torch_dist`` and Megatron -> HF, streaming one layer at a time.

    hf_to_mcore("hf/Qwen2.5-0.5B", "ckpt/qwen", tp=2, pp=2)
    mcore_to_hf("ckpt/qwen", "hf/qwen-rl", hf_config_dir="hf/Qwen2.5-0.5B")

Memory: each direction holds the current layer's input tensors and their converted copies (plus
the embedding/output pair once, and on the way to HF up to one output shard, ``max_shard_bytes``);
never the model. Output is written into ``<out>.tmp-<pid>`` next to ``out`` and renamed to ``out``
only when complete, so a failed run never leaves a directory that looks like a checkpoint; the
temporary directory is removed on failure.

The checkpoint written by ``hf_to_mcore`` does not depend on a layout: ``tp``/``pp``/``vpp``/
``ep``/``etp`` only check that the model can be split that way (vocabulary padding is layout
independent, see ``config/model.py``; experts are stored whole, on an expert axis).
``mcore_to_hf`` reads any checkpoint with this project's model keys (a converted one or a
training checkpoint of ``training/checkpoint.py``, whatever layout it was saved in; optimizer
state is ignored).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_earl.config.model import ModelConfig, ModelConfigError
from megatron_earl.convert import mapping
from megatron_earl.convert.dcp import (
    COMMON_KEY,
    StreamingCheckpointWriter,
    check_checkpoint,
    load_common,
    load_slices,
)
from megatron_earl.convert.families import (
    ConversionError,
    family_by_name,
    family_for_model,
    family_of,
    hf_config_from_model,
    hf_params_dtype,
    model_config_from_hf,
    read_hf_config,
)
from megatron_earl.convert.hf_io import HFReader, ShardedSafetensorsWriter

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HF_EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


@contextlib.contextmanager
def atomic_output_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` on success, delete it on error."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output directory {out} exists and is not empty")
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)


def hf_to_mcore(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    dtype: str | None = None,
) -> ModelConfig:
    """Convert an HF directory of a supported family (``families.FAMILIES``) into a Megatron
    ``torch_dist`` checkpoint.

    ``dtype`` None keeps the HF tensors' dtype (bitwise round trip); else casts. Returns the
    model config (also stored in the checkpoint's ``common.pt``). No process group needed.
    """
    cfg = read_hf_config(hf_dir)
    family = family_of(cfg)
    if dtype is not None and dtype not in _DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    model = model_config_from_hf(
        cfg,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        params_dtype=dtype or hf_params_dtype(cfg),
    )
    try:  # sequence parallelism is the run's choice (MoE needs it at tp > 1), not the weights'
        splits = dataclasses.replace(model, sequence_parallel=True)
        splits.validate_for_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    except ModelConfigError as err:
        raise ConversionError(
            f"target layout tp={tp} pp={pp} vpp={vpp} ep={ep} etp={etp}: {err}"
        ) from err
    reader = HFReader(hf_dir)
    _check_hf_names(reader, model)
    cast = _DTYPES[dtype] if dtype else None
    num_layers = model.num_layers
    with atomic_output_dir(out_dir) as tmp:
        writer = StreamingCheckpointWriter(tmp)
        top = mapping.hf_top_to_mcore(reader.read(mapping.hf_top_names(model)), model)
        writer.write([(k, _cast(t, cast), (0,) * t.dim(), tuple(t.shape)) for k, t in top.items()])
        del top
        for layer in range(num_layers):
            hf = reader.read(mapping.hf_layer_names(model, layer))
            slices = mapping.hf_layer_to_mcore(hf, model, layer)
            del hf
            writer.write(
                [
                    (
                        mapping.LAYER_PREFIX + suffix,
                        _cast(t, cast).unsqueeze(0),
                        (layer,) + (0,) * t.dim(),
                        (num_layers, *t.shape),
                    )
                    for suffix, t in slices.items()
                ],
                objects=dict.fromkeys(mapping.extra_state_keys(model, layer)),
            )
            del slices
        writer.finish(
            {
                COMMON_KEY: {
                    "model_config": model.to_dict(),
                    "family": family.name,
                    "hf_config": cfg,
                    "source": str(hf_dir),
                }
            }
        )
    return model


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _check_hf_names(reader: HFReader, model: ModelConfig) -> None:
    expected = set(mapping.hf_top_names(model))
    for layer in range(model.num_layers):
        expected.update(mapping.hf_layer_names(model, layer))
    names = {n for n in reader.names() if not n.endswith("rotary_emb.inv_freq")}
    if model.tie_embeddings:
        names.discard(mapping.HF_OUTPUT)  # some tied checkpoints store a copy
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise ConversionError(
            f"HF checkpoint {reader.dir} does not match its config.json "
            f"(num_hidden_layers={model.num_layers}, tie_word_embeddings={model.tie_embeddings}): "
            f"missing tensors {missing[:6]}, unexpected tensors {unexpected[:6]}"
        )


def _model_and_family(ckpt_dir: Path, hf_config_dir: str | Path | None, family_name: str | None):
    """(ModelConfig, Family, base HF config) from the checkpoint's metadata and/or --hf-config."""
    stored = load_common(ckpt_dir).get(COMMON_KEY, {})
    if hf_config_dir is not None:
        base = read_hf_config(hf_config_dir)
        family = family_of(base)
        model = model_config_from_hf(base)
        padding = stored.get("model_config", {}).get("make_vocab_size_divisible_by")
        if padding:
            model = dataclasses.replace(model, make_vocab_size_divisible_by=padding)
        return model, family, base
    if "model_config" not in stored:
        raise ConversionError(
            f"{ckpt_dir} carries no model config (common.pt['{COMMON_KEY}']); pass --hf-config"
        )
    model = ModelConfig(**stored["model_config"])
    name = family_name or stored.get("family")
    if name is None:
        raise ConversionError(f"{ckpt_dir} does not say its model family; pass --hf-config")
    return model, family_by_name(name), stored.get("hf_config")


def _infer_vocab_padding(model: ModelConfig, metadata: dict[str, Any]) -> ModelConfig:
    """Match the checkpoint's padded vocabulary (its embedding rows) when --hf-config gave none."""
    rows = metadata[mapping.EMBEDDING].size[0]
    if rows == model.padded_vocab_size or rows < model.vocab_size:
        return model
    return dataclasses.replace(model, make_vocab_size_divisible_by=rows)


def mcore_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    hf_config_dir: str | Path | None = None,
    family: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> ModelConfig:
    """Convert a Megatron ``torch_dist`` checkpoint into an HF safetensors directory.

    The model shape comes from ``hf_config_dir``'s ``config.json`` when given (its tokenizer and
    generation files are copied too), else from the checkpoint's own metadata. Which ranks call:
    one process in a world of its own (see ``dcp.load_slices``).
    """
    ckpt = Path(ckpt_dir)
    metadata = check_checkpoint(ckpt)
    model, fam, base = _model_and_family(ckpt, hf_config_dir, family)
    if mapping.EMBEDDING not in metadata:
        raise ConversionError(f"{ckpt} has no tensor {mapping.EMBEDDING}: not a GPT checkpoint")
    model = _infer_vocab_padding(model, metadata)
    cfg = hf_config_from_model(model, fam, base)
    _check_mcore_shapes(metadata, model)
    with atomic_output_dir(out_dir) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        top_keys = [mapping.EMBEDDING, mapping.FINAL_NORM] + (
            [] if model.tie_embeddings else [mapping.OUTPUT]
        )
        top = load_slices(
            ckpt, {k: (metadata[k].size, metadata[k].properties.dtype, None) for k in top_keys}
        )
        for key in top_keys:
            writer.add(dict(mapping.mcore_to_hf_tensors(key, top.pop(key), model)))
        keys = {mapping.LAYER_PREFIX + s: s for s in mapping.layer_suffixes(model)}
        for layer in range(model.num_layers):
            loaded = load_slices(
                ckpt, {k: (metadata[k].size, metadata[k].properties.dtype, layer) for k in keys}
            )
            writer.add(
                mapping.mcore_layer_to_hf({keys[k]: t for k, t in loaded.items()}, model, layer)
            )
            del loaded
        writer.finish()
        cfg["dtype"] = str(metadata[mapping.EMBEDDING].properties.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if hf_config_dir is not None:
            for name in _HF_EXTRA_FILES:
                if (Path(hf_config_dir) / name).is_file():
                    shutil.copy2(Path(hf_config_dir) / name, tmp / name)
    return model


def export_hf(
    named: Iterable[tuple[str, torch.Tensor]],
    model: ModelConfig,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    base_config: dict | None = None,
) -> int:
    """Write HF-named tensors (e.g. ``weights.sync.hf_named_tensors`` of a trainer's full
    weights) as an HF safetensors directory with its ``config.json``, streaming: at most one
    shard is held. Atomic like ``mcore_to_hf`` (a reader never sees a partial directory).
    ``base_config``: further ``config.json`` fields (the tokenizer's token ids:
    ``convert.engine_model.token_ids_config``). Returns the tensor bytes written. Local; the
    caller holds the tensors."""
    cfg = hf_config_from_model(model, family_for_model(model), base_config)
    dtype = None
    with atomic_output_dir(out_dir) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        for name, tensor in named:
            dtype = dtype or tensor.dtype
            writer.add({name: tensor.detach().cpu()})
        writer.finish()
        cfg["dtype"] = str(dtype or model.torch_dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return writer.total_bytes


def _experts_text(model: ModelConfig) -> str:
    if not model.is_moe:
        return ""
    return f"num_experts={model.num_experts}, moe_ffn_hidden_size={model.expert_ffn_hidden_size}, "


def _check_mcore_shapes(metadata: dict[str, Any], model: ModelConfig) -> None:
    for key, shape in mapping.global_shapes(model).items():
        if key not in metadata:
            raise ConversionError(f"tensor {key} is missing from the checkpoint")
        if tuple(metadata[key].size) != shape:
            raise ConversionError(
                f"tensor {key}: checkpoint shape {tuple(metadata[key].size)} != {shape} expected "
                f"from the model config (num_layers={model.num_layers}, "
                f"hidden_size={model.hidden_size}, ffn_hidden_size={model.ffn_hidden_size}, "
                f"{_experts_text(model)}heads={model.num_attention_heads}, "
                f"query_groups={model.query_groups}, head_dim={model.head_dim}, "
                f"padded vocab={model.padded_vocab_size})"
            )
