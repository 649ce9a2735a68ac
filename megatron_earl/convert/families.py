"""Model-family adapters: a Hugging Face ``config.json`` <-> the project's ``ModelConfig``.

Supported families (decoder-only, RMSNorm, SwiGLU, rotate-half RoPE, GQA, tied or untied
embeddings):

| family    | HF architecture      | attention extras                | MLP                         |
|-----------|----------------------|---------------------------------|-----------------------------|
| llama     | LlamaForCausalLM     | none (Llama 2, 3, 3.1-3.3)      | dense                       |
| qwen2     | Qwen2ForCausalLM     | bias on q/k/v (Qwen2, Qwen2.5)  | dense                       |
| qwen3     | Qwen3ForCausalLM     | RMSNorm on per-head q and k     | dense                       |
| qwen3_moe | Qwen3MoeForCausalLM  | RMSNorm on per-head q and k     | experts, top-k renormalised |
| mixtral   | MixtralForCausalLM   | none                            | experts, top-k renormalised |

Mixtures of experts convert when every layer is one (no ``mlp_only_layers``,
``decoder_sparse_step`` 1) and the top-k weights are renormalised (``norm_topk_prob: true``;
Mixtral always): megatron-core's default router (top-k of the logits, then a softmax over those
k) computes exactly that. Without renormalisation (``norm_topk_prob: false``) HF's weights are the
softmax over all experts, megatron-core's ``moe_router_pre_softmax``, which ``ModelConfig`` does
not expose: refused.

Configs are plain dicts (``config.json`` as read from disk), so conversion needs no
``transformers``. RoPE types ``default``, ``linear``, ``llama3`` and ``yarn`` convert (from
``rope_parameters`` or the older ``rope_scaling``). Anything the Megatron model would compute
differently (o_proj bias, other RoPE types, sliding windows, a non-SiLU activation) is rejected
with an error naming the field; it is never silently dropped. Pure: no torch.distributed, no files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_earl.config.model import ModelConfig, ModelConfigError


class ConversionError(ValueError):
    """Invalid conversion input; the message names the file, tensor or config value involved."""


@dataclass(frozen=True)
class ExpertNames:
    """HF names (relative to ``model.layers.{i}.``) of a mixture-of-experts family's MLP."""

    router: str
    """The router's [num_experts, hidden] weight."""
    gate: str
    """Expert ``{e}``'s gate projection [expert ffn, hidden] (the SiLU-ed half of SwiGLU)."""
    up: str
    """Expert ``{e}``'s up projection [expert ffn, hidden]."""
    down: str
    """Expert ``{e}``'s down projection [hidden, expert ffn]."""
    count_key: str
    """The config field this family's hub configs give the expert count in."""
    width_key: str
    """The config field holding an expert's FFN width."""
    renormalise_key: str | None
    """The config field saying whether the top-k weights are renormalised (absent: transformers'
    default, false); None: the family always renormalises."""


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
    experts: ExpertNames | None = None
    """The mixture of experts' HF names; None: a dense SwiGLU MLP."""


QWEN3_MOE_EXPERTS = ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
    count_key="num_experts",
    width_key="moe_intermediate_size",
    renormalise_key="norm_topk_prob",
)
MIXTRAL_EXPERTS = ExpertNames(
    router="block_sparse_moe.gate.weight",
    gate="block_sparse_moe.experts.{e}.w1.weight",
    up="block_sparse_moe.experts.{e}.w3.weight",
    down="block_sparse_moe.experts.{e}.w2.weight",
    count_key="num_local_experts",
    width_key="intermediate_size",
    renormalise_key=None,
)
FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            qkv_bias=False,
            qk_norm=True,
            experts=QWEN3_MOE_EXPERTS,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "mixtral",
            qkv_bias=False,
            qk_norm=False,
            experts=MIXTRAL_EXPERTS,
        ),
    )
}
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts")
"""Config fields naming the expert count (Qwen's hub configs say num_experts; Mixtral's, and
transformers 5's Qwen3-MoE config, num_local_experts)."""
_BY_NAME = {f.name: f for f in FAMILIES.values()}


def family_by_name(name: str) -> Family:
    if name not in _BY_NAME:
        raise ConversionError(f"unknown model family {name!r}; supported: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def family_for_model(model: Any) -> Family:
    """The HF family whose attention and MLP match a ``ModelConfig`` (qk norm -> qwen3, qkv bias
    -> qwen2, neither -> llama; with experts: qwen3_moe, mixtral); for exporting a policy trained
    from scratch, and for the names of a model's HF tensors."""
    moe = model.is_moe
    matches = [
        f
        for f in FAMILIES.values()
        if (f.qkv_bias, f.qk_norm, f.experts is not None)
        == (model.add_qkv_bias, model.qk_layernorm, moe)
    ]
    if not matches:
        raise ConversionError(
            f"no HF family has qkv bias={model.add_qkv_bias}, qk norm={model.qk_layernorm} and "
            f"experts={moe}; supported: {sorted(_BY_NAME)}"
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


_HF_ROPE_KEYS: dict[str, dict[str, str]] = {
    # HF rope parameter -> ModelConfig field, per rope_type
    "default": {},
    "linear": {"factor": "rope_scaling_factor"},
    "llama3": {
        "factor": "rope_scaling_factor",
        "original_max_position_embeddings": "rope_original_max_position_embeddings",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
    },
    "yarn": {
        "factor": "rope_scaling_factor",
        "original_max_position_embeddings": "rope_original_max_position_embeddings",
        "beta_fast": "yarn_beta_fast",
        "beta_slow": "yarn_beta_slow",
        "mscale": "yarn_mscale",
        "mscale_all_dim": "yarn_mscale_all_dim",
    },
}
"""The RoPE types that convert exactly (Megatron-Core implements each) and their parameters."""
_HF_ROPE_IGNORED = ("rope_type", "type", "rope_theta")


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None):
    """HF's (and Megatron-Core's) default YaRN attention factor."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


def _rope_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` RoPE fields of an HF config: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` + ``rope_theta`` (4.x); a type or parameter Megatron-Core cannot compute
    identically raises ``ConversionError`` naming it."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ConversionError(
            f"per-layer-type RoPE parameters (config rope_parameters {params}) are not supported"
        )
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _HF_ROPE_KEYS:
        raise ConversionError(
            f"RoPE type {rope_type!r} (config rope_parameters/rope_scaling 'rope_type') is not "
            f"supported; supported: {sorted(_HF_ROPE_KEYS)}"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    out: dict[str, Any] = {"rotary_base": float(theta), "rope_type": rope_type}
    keys = _HF_ROPE_KEYS[rope_type]
    extra = dict(params)
    if extra.get("partial_rotary_factor", 1.0) == 1.0:
        extra.pop("partial_rotary_factor", None)
    if rope_type == "yarn":
        if extra.pop("truncate", True) is not True:
            raise ConversionError(
                "rope_parameters truncate=false (YaRN without rounding the correction range) is "
                "not supported"
            )
        attention_factor = extra.pop("attention_factor", None)
    unknown = sorted(k for k in extra if k not in keys and k not in _HF_ROPE_IGNORED)
    if unknown:
        raise ConversionError(
            f"RoPE parameters {unknown} of rope_type {rope_type!r} (config rope_parameters/"
            f"rope_scaling) are not supported; {rope_type!r} reads {sorted(keys) or 'none'}"
        )
    for hf_key, field in keys.items():
        if params.get(hf_key) is not None:
            out[field] = params[hf_key]
    if rope_type in ("llama3", "yarn") and "rope_original_max_position_embeddings" not in out:
        # transformers' standardize_rope_params: the top-level field, else max_position_embeddings
        out["rope_original_max_position_embeddings"] = cfg.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings")
        )
    if rope_type == "yarn":
        if "rope_scaling_factor" not in out:  # transformers: the context ratio
            out["rope_scaling_factor"] = (
                cfg["max_position_embeddings"] / out["rope_original_max_position_embeddings"]
            )
        if not (out.get("yarn_mscale") and out.get("yarn_mscale_all_dim")):
            out.pop("yarn_mscale", None)  # HF reads them only as a pair of non-zero values
            out.pop("yarn_mscale_all_dim", None)
        expected = _yarn_attention_factor(
            out["rope_scaling_factor"], out.get("yarn_mscale"), out.get("yarn_mscale_all_dim")
        )
        if attention_factor is not None and not math.isclose(attention_factor, expected):
            raise ConversionError(
                f"rope_parameters attention_factor={attention_factor} differs from the one the "
                f"factor and mscale give ({expected}); an explicit YaRN attention factor is not "
                "supported"
            )
    return out


def hf_rope_parameters(model: ModelConfig) -> dict[str, Any]:
    """The HF ``rope_parameters`` of ``model`` (``rope_type``, ``rope_theta`` and the type's
    parameters, the values the model computes with)."""
    params: dict[str, Any] = {"rope_type": model.rope_type, "rope_theta": model.rotary_base}
    for hf_key, field in _HF_ROPE_KEYS[model.rope_type].items():
        if getattr(model, field) is not None:
            params[hf_key] = getattr(model, field)
    return params


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
    if "use_sliding_window" not in cfg and cfg.get("sliding_window") is not None:
        # Mistral/Mixtral: no switch, a window is applied whenever sliding_window is set
        problems.append(
            f"sliding_window={cfg['sliding_window']} (sliding-window attention is not supported)"
        )
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


def _experts_from_hf(cfg: dict[str, Any], family: Family) -> dict[str, Any]:
    """``ModelConfig`` MoE fields of an HF config (none for a dense family); everything that would
    make the Megatron MoE layer compute something else raises ``ConversionError`` naming it."""
    names = family.experts
    if names is None:
        return {}
    counts = {k: cfg[k] for k in _NUM_EXPERTS_KEYS if k in cfg}
    problems = []
    if not counts:
        raise ConversionError(
            f"config.json lacks the expert count ({' or '.join(_NUM_EXPERTS_KEYS)})"
        )
    if len(set(counts.values())) > 1:
        problems.append(f"{counts} disagree")
    num_experts = next(iter(counts.values()))
    topk = cfg.get("num_experts_per_tok")
    if topk is None:
        raise ConversionError("config.json lacks num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        problems.append(f"{next(iter(counts))}={num_experts} (a mixture needs >= 1 expert)")
    elif not isinstance(topk, int) or not 1 <= topk <= num_experts:
        problems.append(f"num_experts_per_tok={topk} (must be in [1, {num_experts}])")
    if names.width_key not in cfg:
        raise ConversionError(f"config.json lacks {names.width_key}")
    if names.renormalise_key is not None and not cfg.get(names.renormalise_key, False):
        problems.append(
            f"{names.renormalise_key}={cfg.get(names.renormalise_key, 'absent (false)')} (the "
            "top-k weights as the softmax over all experts, not renormalised, is megatron-core's "
            "moe_router_pre_softmax, which ModelConfig does not expose; only "
            f"{names.renormalise_key}=true converts)"
        )
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        problems.append(
            f"decoder_sparse_step={cfg.get('decoder_sparse_step', 1)}, mlp_only_layers="
            f"{cfg.get('mlp_only_layers')} (dense layers between the MoE layers: ModelConfig has "
            "no moe_layer_freq; every layer must be a mixture, decoder_sparse_step=1 and no "
            "mlp_only_layers)"
        )
    if cfg.get("router_jitter_noise"):
        problems.append(
            f"router_jitter_noise={cfg['router_jitter_noise']} (only 0: megatron-core's "
            "moe_input_jitter_eps is another noise)"
        )
    if problems:
        raise ConversionError(
            f"{family.architecture} config not convertible: " + "; ".join(problems)
        )
    fields: dict[str, Any] = {"num_experts": num_experts, "moe_router_topk": topk}
    if names.width_key != "intermediate_size":
        fields["moe_ffn_hidden_size"] = cfg[names.width_key]
    return fields


def model_config_from_hf(
    hf_config: dict[str, Any],
    *,
    make_vocab_size_divisible_by: int = 128,
    params_dtype: str = "float32",
) -> ModelConfig:
    """The ``ModelConfig`` of an HF config of a supported family (raises ``ConversionError``)."""
    family = family_of(hf_config)
    _check_unsupported(hf_config, family)
    experts = _experts_from_hf(hf_config, family)
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
    fields = dict(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        vocab_size=hf_config["vocab_size"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
        norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        params_dtype=params_dtype,
    )
    try:  # RoPE settings are validated here, before any weight is read
        return ModelConfig(**fields, **experts, **_rope_from_hf(hf_config))
    except ModelConfigError as err:
        raise ConversionError(f"config.json: {err}") from None


def hf_config_from_model(
    model: ModelConfig, family: Family, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An HF ``config.json`` dict for ``model``; fields of ``base`` (e.g. token ids) are kept.

    Raises ``ConversionError`` when ``model`` cannot be expressed in ``family`` (a QKV bias
    outside Qwen2, q/k norms outside Qwen3, experts outside an MoE family, a router HF's does not
    compute).
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
    _check_experts_expressible(model, family)
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
        # transformers 5 reads rope_parameters; 4.x (and SGLang's copy) read rope_theta and
        # rope_scaling.
        rope_parameters=hf_rope_parameters(model),
        rope_theta=model.rotary_base,
        dtype=model.params_dtype,
    )
    cfg.pop("rope_scaling", None)
    if model.rope_type != "default":
        scaling = hf_rope_parameters(model)
        del scaling["rope_theta"]
        cfg["rope_scaling"] = scaling
    cfg.pop("torch_dtype", None)
    if not family.qkv_bias:
        cfg["attention_bias"] = False
    if family.experts is not None:
        _write_experts(cfg, model, family.experts)
    return cfg


def _check_experts_expressible(model: ModelConfig, family: Family) -> None:
    """``ConversionError`` naming each MoE setting ``family``'s HF model would compute
    otherwise. Load balancing (aux loss, z-loss, its type) shapes only training and is not
    part of the exported model."""
    if model.is_moe != (family.experts is not None):
        raise ConversionError(
            f"num_experts={model.num_experts} cannot be expressed as {family.architecture} "
            f"({'a mixture of experts' if family.experts else 'a dense MLP'})"
        )
    if not model.is_moe:
        return
    problems = []
    if model.moe_shared_expert_intermediate_size:
        problems.append(
            f"moe_shared_expert_intermediate_size={model.moe_shared_expert_intermediate_size} "
            "(no shared expert)"
        )
    if model.moe_router_score_function != "softmax":
        problems.append(f"moe_router_score_function={model.moe_router_score_function!r} (softmax)")
    if model.moe_router_enable_expert_bias:
        problems.append("moe_router_enable_expert_bias=true (no expert bias)")
    if model.moe_expert_capacity_factor is not None:
        problems.append(
            f"moe_expert_capacity_factor={model.moe_expert_capacity_factor} (no token is dropped)"
        )
    if problems:
        raise ConversionError(
            f"model cannot be expressed as {family.architecture}: " + "; ".join(problems)
        )


def _write_experts(cfg: dict[str, Any], model: ModelConfig, names: ExpertNames) -> None:
    """The MoE fields of ``cfg`` (an expert count already in ``cfg`` under either name is
    overwritten, so the two never disagree)."""
    present = [k for k in _NUM_EXPERTS_KEYS if k in cfg]
    for key in present or [names.count_key]:
        cfg[key] = model.num_experts
    cfg["num_experts_per_tok"] = model.moe_router_topk
    cfg[names.width_key] = model.expert_ffn_hidden_size
    if names.renormalise_key is not None:  # Qwen-MoE: every layer sparse, renormalised top-k
        cfg[names.renormalise_key] = True
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = []
