"""What ``megatron-earl serve`` serves, resolved at start-up as SGLang resolves ``--model-path``,
and how it describes it (``/get_model_info``, ``/get_server_info``, ``/v1/models``).

    served = resolve_model(args.model_path, args.model_config, args.tokenizer_path)
    chunks = build_model(served.model_config); load_weights(chunks, served)

``--model-path`` is one of

- an HF directory (``config.json`` + ``model.safetensors`` or a sharded index, as SGLang loads
  and ``convert.export_hf`` / ``mcore_to_hf`` write): the ``ModelConfig`` comes from
  ``config.json`` (``convert.families``: Llama/Qwen2/Qwen3, default RoPE; anything else is an
  error naming the field), the weights are read with ``serve.weights.read_weights`` (the reader
  of ``update_weights_from_disk``) and must be complete; the model's dtype is ``config.json``'s;
- a file: a ``torch.save``'d full Megatron state dict (``geometry.full_state_dict``), the
  model from ``--model-config`` (a JSON file of ``ModelConfig`` fields; default the tiny one);
- ``random`` (or nothing): seeded random weights (``--seed``), the model from ``--model-config``.

Text: the tokenizer of ``--tokenizer-path`` (SGLang's flag), else of the HF directory when it
has one (``tokenizer.json`` / ``tokenizer_config.json`` / ``tokenizer.model``; loaded with
``transformers`` from the directory only, with its chat template when present). ``text`` is
encoded as SGLang does (``tokenizer.encode(text)``, special tokens added) and decoded with
``skip_special_tokens`` as the request asks (SGLang's default: true); the model's end-of-sequence
ids (``config.json`` and ``generation_config.json`` ``eos_token_id``, the tokenizer's
``eos_token_id``) stop generation unless ``ignore_eos``, as SGLang's scheduler does. Without a
tokenizer (a Megatron checkpoint, an HF directory without one) text uses the byte-level stand-in
(id < 256 = that byte; only when the vocabulary has >= 256 ids) and ``/get_model_info`` says so
(``tokenizer_path`` null, ``tokenizer`` "byte-level stand-in")."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_earl import runtime
from megatron_earl.config.model import ModelConfig
from megatron_earl.rollout.serve.weights import check_named, expected_hf_tensors, read_weights

RANDOM = "random"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Files whose presence makes a directory a tokenizer directory."""


class ModelPathError(ValueError):
    """``--model-path`` / ``--tokenizer-path`` / ``--model-config`` cannot be served."""


class ByteCodec:
    """The byte-level stand-in: id < 256 is that byte (needs a vocabulary of >= 256 ids)."""

    name = "byte-level stand-in"
    path: str | None = None
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFCodec:
    """A ``transformers`` tokenizer used as SGLang's tokenizer manager and detokenizer use it."""

    def __init__(self, path: str, vocab_size: int):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # transformers raises many kinds; all mean "not loadable"
            raise ModelPathError(
                f"cannot load a tokenizer from {path!r}: {type(err).__name__}: {err}"
            ) from None
        if len(self.tokenizer) > vocab_size:
            raise ModelPathError(
                f"tokenizer {path!r} has {len(self.tokenizer)} ids, more than the model's "
                f"vocabulary of {vocab_size}"
            )
        self.name = type(self.tokenizer).__name__
        self.path = path
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (eos,)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


@dataclass
class ServedModel:
    """The resolved ``--model-path``: model shape, where its weights are, how text is coded."""

    model_config: ModelConfig
    model_path: str
    """As given (``random`` when none was)."""
    kind: str
    """``hf`` (a directory), ``full_state`` (a ``torch.save`` file) or ``random``."""
    hf_config: dict[str, Any] | None
    """``config.json`` of an HF directory, else None."""
    codec: ByteCodec | HFCodec | None
    """Text <-> ids (None: no text; the vocabulary is too small for the byte stand-in)."""
    eos_token_ids: tuple[int, ...] = ()
    """Ids that end generation unless ``ignore_eos`` (SGLang's model eos); none without HF."""
    served_model_name: str = ""
    """``--served-model-name`` (default: ``model_path``)."""
    startup_time: float = field(default_factory=time.time)


def _eos_ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def resolve_model(
    model_path: str | None,
    model_config_file: str | None = None,
    tokenizer_path: str | None = None,
    served_model_name: str | None = None,
) -> ServedModel:
    """``--model-path`` (and friends) -> ``ServedModel``; ``ModelPathError`` names what is wrong."""
    from megatron_earl.convert.families import (
        ConversionError,
        hf_params_dtype,
        model_config_from_hf,
        read_hf_config,
    )

    path = model_path or RANDOM
    hf_config = None
    if path != RANDOM and Path(path).is_dir():
        if model_config_file:
            raise ModelPathError(
                f"--model-config {model_config_file!r} with the HF directory {path!r}: the "
                "directory's config.json defines the model (--model-config is for a Megatron "
                "full-state file or 'random')"
            )
        try:
            hf_config = read_hf_config(path)
            model = model_config_from_hf(hf_config, params_dtype=hf_params_dtype(hf_config))
        except ConversionError as err:
            raise ModelPathError(f"--model-path {path!r} cannot be served: {err}") from None
        kind = "hf"
        if tokenizer_path is None and any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
            tokenizer_path = path
    else:
        if path != RANDOM and not Path(path).is_file():
            raise ModelPathError(
                f"--model-path {path!r} does not exist; give an HF directory (config.json + "
                "safetensors), a torch.save'd full Megatron state file, or 'random'"
            )
        model = ModelConfig()
        if model_config_file:
            with open(model_config_file) as f:
                model = ModelConfig(**json.load(f))
        kind = RANDOM if path == RANDOM else "full_state"
    if tokenizer_path is not None:
        codec: ByteCodec | HFCodec | None = HFCodec(tokenizer_path, model.padded_vocab_size)
    else:
        codec = ByteCodec() if model.vocab_size >= 256 else None
    eos: set[int] = set(codec.eos_token_ids) if codec else set()
    if hf_config is not None:
        eos |= _eos_ids(hf_config.get("eos_token_id"))
        generation = Path(path) / "generation_config.json"
        if generation.is_file():
            eos |= _eos_ids(json.loads(generation.read_text()).get("eos_token_id"))
    return ServedModel(
        model,
        path,
        kind,
        hf_config,
        codec,
        eos_token_ids=tuple(sorted(eos)),
        served_model_name=served_model_name or path,
    )


def load_weights(model_chunks: list[torch.nn.Module], served: ServedModel) -> None:
    """Load the weights of ``served`` into the model (world of one); ``random`` loads nothing.
    An HF directory must hold every tensor of the model, with its shapes and dtype."""
    from megatron_earl.models.hf_mapping import hf_to_megatron
    from megatron_earl.redistribute.geometry import load_full_state_dict

    if served.kind == RANDOM:
        return
    try:
        _, weights = read_weights(Path(served.model_path), None)
    except (ValueError, OSError, RuntimeError) as err:  # incl. ConversionError, unpickling
        raise ModelPathError(f"cannot read --model-path {served.model_path!r}: {err}") from None
    if served.kind == "full_state":
        load_full_state_dict(model_chunks, weights)
        return
    model = served.model_config
    expected = expected_hf_tensors(model, model.torch_dtype)
    if model.tie_embeddings:  # some tied checkpoints store a copy of the embedding
        weights = [(n, t) for n, t in weights if not (n == "lm_head.weight" and n not in expected)]
    try:
        check_named(weights, expected)
    except ValueError as err:
        raise ModelPathError(f"--model-path {served.model_path!r}: {err}") from None
    missing = sorted(set(expected) - {n for n, _ in weights})
    if missing:
        raise ModelPathError(
            f"--model-path {served.model_path!r} lacks tensors of its config.json's model: "
            f"{missing[:6]}{' ...' if len(missing) > 6 else ''}"
        )
    load_full_state_dict(model_chunks, hf_to_megatron(dict(weights), model))


# ---------------------------------------------------------------------------- info endpoints
# Field names and shapes of SGLang 0.5.23's ``http_server.py`` (``model_info``, ``server_info``,
# ``available_models``) and ``sglang/api/v1/api_types.py`` (``GetModelInfoResponse``,
# ``GetServerInfoResponse``, ``ModelCard``); extra fields are ours and marked below.


def _hf_identity(served: ServedModel) -> tuple[str | None, list[str] | None]:
    """(model_type, architectures): config.json's, else the HF family the exporter would write
    (the names weight updates use); None when no family expresses the model."""
    from megatron_earl.convert.families import ConversionError, family_for_model

    if served.hf_config is not None:
        return served.hf_config.get("model_type"), served.hf_config.get("architectures")
    try:
        family = family_for_model(served.model_config)
    except ConversionError:
        return None, None
    return family.model_type, [family.architecture]


def model_info_json(served: ServedModel, weight_version: int) -> dict[str, Any]:
    """``/get_model_info`` (``/model_info``)."""
    model_type, architectures = _hf_identity(served)
    return {
        "model_path": served.model_path,
        "served_model_name": served.served_model_name,
        "tokenizer_path": served.codec.path if served.codec else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(weight_version),
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": architectures,
        # ours: the Megatron model served, and what codes text (an HF tokenizer's class or
        # "byte-level stand-in"; null: no text, send input_ids)
        "model_config": served.model_config.to_dict(),
        "tokenizer": served.codec.name if served.codec else None,
    }


def server_args_json(args: Any, served: ServedModel) -> dict[str, Any]:
    """The launch arguments under SGLang's ``ServerArgs`` names (keys never included)."""
    return {
        "model_path": served.model_path,
        "tokenizer_path": served.codec.path if served.codec else None,
        "served_model_name": served.served_model_name,
        "host": args.host,
        "port": args.port,
        "tp_size": args.tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "context_length": args.max_seq_len,
        "max_running_requests": args.max_batch_size,
        "max_total_tokens": None,
        "mem_fraction_static": args.mem_fraction_static,
        "random_seed": args.seed,
        "skip_server_warmup": args.skip_server_warmup,
        "enable_memory_saver": args.enable_memory_saver,
        "enable_torch_compile": args.compile_decode,
        "load_format": "auto",
        "dtype": served.model_config.params_dtype,
        "skip_tokenizer_init": served.codec is None,
        "is_embedding": False,
        "device": runtime.policy().device.type,  # cuda on a GPU machine, as SGLang says
        "incremental_streaming_output": False,
        "disaggregation_mode": "null",
    }


def server_info_json(
    server_args: dict[str, Any],
    served: ServedModel,
    *,
    max_batch_size: int,
    max_seq_len: int,
    paused: bool,
) -> dict[str, Any]:
    """``/get_server_info`` (``/server_info``): SGLang's server arguments, the scheduler's start
    info (``max_total_num_tokens``: the KV rows' token capacity, ``max_req_input_len``: the
    longest prompt that still gets one new token) and one ``internal_states`` entry (one DP
    rank)."""
    from megatron_earl.rollout.sglang.client import SGLANG_PINNED

    total = max_batch_size * max_seq_len
    internal = {
        **server_args,
        "world_size": 1,
        "startup_time": served.startup_time,
        "effective_max_running_requests_per_dp": max_batch_size,
    }
    return {
        **server_args,
        "launch_command": None,
        "status": "ready",
        "max_total_num_tokens": total,
        "max_req_input_len": min(max_seq_len, total) - 1,
        "max_context_length": max_seq_len,
        "startup_time": served.startup_time,
        "internal_states": [internal],
        "deployment_info": None,
        "version": SGLANG_PINNED,  # the SGLang API this server answers as
        # ours
        "engine": "megatron-earl serve",
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "paused": paused,
    }


def model_card_json(served: ServedModel, max_seq_len: int) -> dict[str, Any]:
    """One OpenAI model card as SGLang's ``ModelCard``."""
    return {
        "id": served.served_model_name,
        "object": "model",
        "created": int(served.startup_time),
        "owned_by": "sglang",
        "root": served.served_model_name,
        "parent": None,
        "max_model_len": max_seq_len,
    }


def models_json(served: ServedModel, max_seq_len: int) -> dict[str, Any]:
    """``/v1/models``: SGLang's ``ModelList`` of the one served model (no LoRA adapters)."""
    return {"object": "list", "data": [model_card_json(served, max_seq_len)]}


def model_not_found_json(name: str) -> dict[str, Any]:
    """``/v1/models/{name}`` for another name: SGLang's 404 body."""
    return {
        "error": {
            "message": f"The model '{name}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
