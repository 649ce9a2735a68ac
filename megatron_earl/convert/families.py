"""Model-family adapters: a Hugging Face ``config.json`` <-> the project's ``ModelConfig``.

Supported families (decoder-only, RMSNorm, SwiGLU, rotate-half RoPE, GQA, tied or untied
embeddings):

| family | HF architecture      | attention extras                    |
|--------|----------------------|-------------------------------------|
| llama  | LlamaForCausalLM     | none (Llama 2 and 3, default RoPE)  |
| qwen2  | Qwen2ForCausalLM     | bias on q/k/v (Qwen2, Qwen2.5)      |
| qwen3  | Qwen3ForCausalLM     | RMSNorm on per-head q and k         |

Configs are plain dicts (``config.json`` as read from disk), so conversion needs no
``transformers``. Anything the Megatron model would compute differently (o_proj bias, RoPE
scaling, sliding windows, a non-SiLU activation) is rejected with an error naming the field; it is
never silently dropped. Pure: no torch.distributed, no files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_earl.config.model import ModelConfig


class ConversionError(ValueError):
    """Invalid conversion input; the message names the file, tensor or config value involved."""


@dataclass(frozen=True)
class Family:
    """One HF model family and what its attention adds to the common Llama block."""

    name: str
    """Short name: llama, qwen2 or qwen3."""
    architecture: str
    """HF ``architectures[0]``."""
    model_type: str
    """HF ``model_type``."""
    qkv_bias: bool
    """q/k/v projections carry a bias (o_proj never does)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys (``q_norm``/``k_norm``)."""


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True),
    )
}
_BY_NAME = {f.name: f for f in FAMILIES.values()}


def family_by_name(name: str) -> Family:
    if name not in _BY_NAME:
        raise ConversionError(f"unknown model family {name!r}; supported: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def family_for_model(model: Any) -> Family:
    """The HF family whose attention matches a ``ModelConfig`` (qk norm -> qwen3, qkv bias ->
    qwen2, neither -> llama); for exporting a policy trained from scratch."""
    matches = [
        f
        for f in FAMILIES.values()
        if (f.qkv_bias, f.qk_norm) == (model.add_qkv_bias, model.qk_layernorm)
    ]
    if not matches:
        raise ConversionError(
            f"no HF family has qkv bias={model.add_qkv_bias} and qk norm={model.qk_layernorm}; "
            f"supported: {sorted(_BY_NAME)}"
        )
    return matches[0]


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} not found: --hf must be a Hugging Face model directory")
    return json.loads(path.read_text())


def family_of(hf_config: dict[str, Any]) -> Family:
    """The family of an HF config, from ``architectures[0]``."""
    archs = hf_config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in FAMILIES:
        raise ConversionError(
            f"unsupported architecture {archs!r} (config.json 'architectures'); supported: "
            f"{sorted(FAMILIES)}"
        )
    return FAMILIES[archs[0]]


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ConversionError(
            f"RoPE type {rope_type!r} (config rope_parameters/rope_scaling) is not supported; "
            "only 'default' RoPE converts exactly"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def _check_unsupported(cfg: dict[str, Any], family: Family) -> None:
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu')")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP biases are not supported)")
    if cfg.get("attention_bias") and not family.qkv_bias:
        problems.append(f"attention_bias=true for {family.name} (o_proj bias is not supported)")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention is not supported)")
    if cfg.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={cfg['pretraining_tp']} (only 1)")
    if problems:
        raise ConversionError(
            f"{family.architecture} config not convertible: " + "; ".join(problems)
        )


PARAMS_DTYPES = ("float32", "bfloat16", "float16")


def hf_params_dtype(cfg: dict[str, Any]) -> str:
    """The ``params_dtype`` of an HF config (its ``dtype`` / ``torch_dtype``; float32 when it
    names none of ``PARAMS_DTYPES``)."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return name if name in PARAMS_DTYPES else "float32"


def model_config_from_hf(
    hf_config: dict[str, Any],
    *,
    make_vocab_size_divisible_by: int = 128,
    params_dtype: str = "float32",
) -> ModelConfig:
    """The ``ModelConfig`` of an HF Llama/Qwen2/Qwen3 config (raises ``ConversionError``)."""
    family = family_of(hf_config)
    _check_unsupported(hf_config, family)
    required = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "vocab_size",
    )
    missing = [k for k in required if k not in hf_config]
    if missing:
        raise ConversionError(f"config.json lacks {missing}")
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim")
    if head_dim == hf_config["hidden_size"] // heads and hf_config["hidden_size"] % heads == 0:
        head_dim = None  # the default: keep the config canonical
    return ModelConfig(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        vocab_size=hf_config["vocab_size"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
        rotary_base=_rope_theta(hf_config),
        norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        params_dtype=params_dtype,
    )


def hf_config_from_model(
    model: ModelConfig, family: Family, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An HF ``config.json`` dict for ``model``; fields of ``base`` (e.g. token ids) are kept.

    Raises ``ConversionError`` when ``model`` cannot be expressed in ``family`` (a QKV bias
    outside Qwen2, q/k norms outside Qwen3).
    """
    if model.qk_layernorm != family.qk_norm:
        raise ConversionError(
            f"qk_layernorm={model.qk_layernorm} cannot be expressed as {family.architecture} "
            f"(q/k norm {family.qk_norm})"
        )
    if model.add_qkv_bias != family.qkv_bias:
        raise ConversionError(
            f"add_qkv_bias={model.add_qkv_bias} cannot be expressed as {family.architecture} "
            f"(q/k/v bias {family.qkv_bias})"
        )
    cfg = dict(base or {})
    cfg.update(
        architectures=[family.architecture],
        model_type=family.model_type,
        num_hidden_layers=model.num_layers,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.query_groups,
        head_dim=model.head_dim,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=model.tie_embeddings,
        # transformers 5 reads rope_parameters; 4.x (and SGLang's copy) read rope_theta.
        rope_parameters={"rope_type": "default", "rope_theta": model.rotary_base},
        rope_theta=model.rotary_base,
        dtype=model.params_dtype,
    )
    cfg.pop("rope_scaling", None)
    cfg.pop("torch_dtype", None)
    if family.name in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    return cfg
