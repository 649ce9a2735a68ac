"""What each SGLang engine is, read from the engine at start-up, and whether the run can use it.

    identities = await asyncio.gather(*(read_identity(c) for c in clients))   # comms
    check = check_engines(identities, settings, model)                          # pure
    check.raise_problems()          # EngineMismatch naming the first difference per engine
    settings = dataclasses.replace(settings, engine_tp=check.engine_tp)

An engine is read through ``/get_server_info`` (SGLang's version, ``tp_size``, ``device``; serve
adds ``"engine": "megatron-earl serve"``) and ``/get_model_info`` (``architectures``,
``model_type``, ``model_path``; serve adds its Megatron ``model_config``). When the engine's
``model_path`` is a directory this host can read, its ``config.json`` is compared too.

Refused (``problems``), before any weight moves:
- the engines disagree on their TP size, or ``rollout.sglang.engine_tp`` is set and differs
  from theirs (tensor payloads per engine and the distributed group's ranks depend on it);
- a real SGLang engine with ``tensor_payload: portable`` (SGLang unpickles the payload inside
  the weight-update session and its whole server process dies on this format);
- an engine on CPU with ``group_backend: nccl``;
- an engine serving another architecture, or a model whose shape (vocabulary, hidden size,
  layers, heads, KV heads, FFN size) differs from the trainer's: the first difference is named.

Warned: an SGLang version outside ``TESTED_SGLANG_VERSIONS``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.config.vocab import TensorPayload, WeightUpdate
from megatron_earl.rollout.engine import EngineError

TESTED_SGLANG_VERSIONS = ("0.5.23",)
"""SGLang releases the real-SGLang tier (``tests/sglang``) runs against."""
SERVE_ENGINE = "megatron-earl serve"
"""``/get_server_info``'s ``engine`` field of ``megatron-earl serve``."""

HF_SHAPE_KEYS = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_query_groups"),
    ("intermediate_size", "ffn_hidden_size"),
)
"""(HF config.json key, ModelConfig field) pairs an engine's model must share with the trainer."""


def engine_tp_size(server_info: dict[str, Any]) -> int:
    """An engine's TP size from its ``/get_server_info`` (1 when it does not say)."""
    return int(server_info.get("tp_size") or 1)


class EngineMismatch(EngineError):
    """An engine the run cannot use as configured (start-up, before any weight moves)."""


@dataclass(frozen=True)
class EngineIdentity:
    """What one engine says it is."""

    url: str
    version: str | None
    is_serve: bool
    tp_size: int
    device: str | None
    architectures: tuple[str, ...]
    model_type: str | None
    model_path: str | None
    hf_config: dict[str, Any] | None = None
    """The engine's ``config.json`` when this host can read it (or serve's model as HF keys)."""


@dataclass
class EngineCheck:
    """The verdict on a run's engines."""

    engine_tp: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def raise_problems(self) -> None:
        if self.problems:
            raise EngineMismatch(
                "the SGLang engines cannot be used as configured:\n- " + "\n- ".join(self.problems)
            )


async def read_identity(client: Any) -> EngineIdentity:
    """Read one engine (an ``SGLangClient``)."""
    server = await client.get_server_info()
    model = await client.get_model_info()
    is_serve = server.get("engine") == SERVE_ENGINE
    hf_config = None
    if is_serve and isinstance(model.get("model_config"), dict):
        hf_config = _hf_keys(model["model_config"])
    elif isinstance(model.get("model_path"), str):
        hf_config = _read_config(model["model_path"])
    return EngineIdentity(
        url=client.base_url,
        version=_str_or_none(server.get("version")),
        is_serve=is_serve,
        tp_size=engine_tp_size(server),
        device=_str_or_none(server.get("device")),
        architectures=tuple(model.get("architectures") or ()),
        model_type=_str_or_none(model.get("model_type")),
        model_path=_str_or_none(model.get("model_path")),
        hf_config=hf_config,
    )


def check_engines(
    identities: Sequence[EngineIdentity], settings: SGLangConfig, model: ModelConfig
) -> EngineCheck:
    """Whether the run can use these engines as ``settings`` and ``model`` say (pure)."""
    from megatron_earl.convert.families import ConversionError, family_for_model

    sizes = {e.tp_size for e in identities}
    engine_tp = settings.engine_tp if settings.engine_tp is not None else min(sizes, default=1)
    check = EngineCheck(engine_tp)
    if len(sizes) > 1:
        check.problems.append(
            "the engines' TP sizes differ: "
            + ", ".join(f"{e.url} tp_size={e.tp_size}" for e in identities)
        )
    try:
        architecture = family_for_model(model).architecture
    except ConversionError:
        architecture = None
    for e in identities:
        if e.version is not None and e.version not in TESTED_SGLANG_VERSIONS:
            check.warnings.append(
                f"{e.url} runs SGLang {e.version}; this project is tested with "
                f"{', '.join(TESTED_SGLANG_VERSIONS)}"
            )
        if settings.engine_tp is not None and e.tp_size != settings.engine_tp:
            check.problems.append(
                f"{e.url} runs with tp_size={e.tp_size}, rollout.sglang.engine_tp is "
                f"{settings.engine_tp} (leave it unset to take the engines')"
            )
        if (
            settings.weight_update == WeightUpdate.TENSOR
            and settings.tensor_payload == TensorPayload.PORTABLE
            and not e.is_serve
        ):
            check.problems.append(
                f"{e.url} is SGLang, which cannot read tensor_payload 'portable' (its server "
                "process dies on it); use rollout.sglang.tensor_payload: sglang (engines on "
                "this host), weight_update: distributed, or weight_update: disk"
            )
        if (
            settings.weight_update == WeightUpdate.DISTRIBUTED
            and settings.group_backend == "nccl"
            and e.device == "cpu"
        ):
            check.problems.append(
                f"{e.url} runs on CPU; its weight-update group needs group_backend 'gloo', "
                "not 'nccl'"
            )
        if difference := model_difference(e, model, architecture):
            check.problems.append(f"{e.url} serves another model: {difference}")
    return check


def model_difference(
    engine: EngineIdentity, model: ModelConfig, architecture: str | None
) -> str | None:
    """The first way the engine's model differs from the trainer's, or None."""
    if architecture and engine.architectures and engine.architectures[0] != architecture:
        return (
            f"architecture {engine.architectures[0]}, the trainer's model is {architecture} "
            f"(its {'qkv bias' if model.add_qkv_bias else 'no qkv bias'}, "
            f"{'qk norm' if model.qk_layernorm else 'no qk norm'})"
        )
    if engine.hf_config is None:
        return None
    for hf_key, field_name in HF_SHAPE_KEYS:
        ours = getattr(model, field_name)
        if field_name == "num_query_groups" and ours is None:
            ours = model.num_attention_heads
        theirs = engine.hf_config.get(hf_key)
        if hf_key == "num_key_value_heads" and theirs is None:
            theirs = engine.hf_config.get("num_attention_heads")
        if theirs is not None and theirs != ours:
            return f"{hf_key}={theirs}, the trainer's model has {field_name}={ours}"
    return None


def _hf_keys(model_config: dict[str, Any]) -> dict[str, Any]:
    """serve's Megatron ``model_config`` under the HF keys ``HF_SHAPE_KEYS`` compares."""
    out = {hf: model_config.get(ours) for hf, ours in HF_SHAPE_KEYS}
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = model_config.get("num_attention_heads")
    return out


def _read_config(model_path: str) -> dict[str, Any] | None:
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # another host's path, or not an HF directory: the architecture still counts
    text = config.get("text_config")  # multimodal configs nest the language model's
    return text if isinstance(text, dict) else config


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
