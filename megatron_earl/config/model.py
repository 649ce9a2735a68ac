"""Typed model config for Llama/Qwen-family GPT models, and the one place that builds Megatron's
``TransformerConfig`` from it.

The global shapes (and so the checkpoint) never depend on the parallel layout. The vocabulary is
padded by ``vocab_padding``: "earl" (default) to a multiple of ``make_vocab_size_divisible_by``;
"megatron-lm" to a multiple of ``make_vocab_size_divisible_by`` x ``vocab_padding_tp``,
Megatron-LM's rule at the TP of the Megatron-LM run (Llama-3's 128256 at 128 x TP8: 129024), fixed
for every layout here so a model still switches TP sizes without changing shape. A layout whose TP
does not divide the padded vocabulary is rejected by ``validate_for_parallel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from megatron_earl.config.vocab import TransformerImpl, VocabPadding

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer import TransformerConfig

_DTYPES = ("float32", "bfloat16", "float16")
"""``params_dtype`` values, each the ``torch`` dtype of its name. The config imports no ``torch``:
``megatron-earl train`` validates a run before it starts torchrun, in a process that never needs
torch (one import fewer per launch, ~1 s)."""
ATTENTION_BACKENDS = ("sdpa", "local")
"""Core attention of the local spec: the project's SDPAttention, Megatron's DotProductAttention."""
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""Transformer Engine's context-parallel communication schemes (Megatron's ``cp_comm_type``)."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants (HF ``rope_type`` names), each Megatron-Core's own: ``linear`` is position
interpolation (``seq_len_interpolation_factor``), ``llama3`` Llama 3.x frequency scaling
(``RotaryEmbedding`` with ``rope_scaling``), ``yarn`` ``YarnRotaryEmbedding``."""
ROPE_SCALING_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("rope_scaling_factor",),
    "llama3": (
        "rope_scaling_factor",
        "rope_original_max_position_embeddings",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
    ),
    "yarn": (
        "rope_scaling_factor",
        "rope_original_max_position_embeddings",
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_mscale",
        "yarn_mscale_all_dim",
    ),
}
"""The scaling fields each ``rope_type`` reads; any other one set is a conflict."""
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""Router score functions (megatron-core's ``moe_router_score_function``)."""
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""Router load balancing (megatron-core's ``moe_router_load_balancing_type``): the Switch /
GShard auxiliary loss per micro-batch, per sequence (DeepSeek-V2/V3), over the global batch;
Sinkhorn (S-BASE); none (e.g. with the aux-loss-free expert bias)."""
MOE_DROP_POLICIES = ("probs", "position")
"""Which tokens an expert over its capacity drops: lowest router probability, or last position."""
MOE_DISPATCHERS = ("alltoall", "allgather")
"""Token dispatchers: all-to-all(-v) among the expert-parallel ranks (any token counts), or an
all-gather over the ep x etp ranks (equal token counts on them: see ``validate_for_parallel``)."""
_MOE_DEFAULTS = {
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_score_function": "softmax",
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_token_dispatcher_type": "alltoall",
    "moe_grouped_gemm": True,
}
"""The MoE fields and their defaults; a dense model (no ``num_experts``) must leave them so."""
_ROPE_DEFAULTS = {
    "llama3": {  # Llama 3.1's values, Megatron-Core's defaults for --use-rope-scaling
        "rope_original_max_position_embeddings": 8192,
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
    },
    "yarn": {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0},
}


class ModelConfigError(ValueError):
    """An invalid model configuration; the message names every value involved."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama/Qwen-family decoder-only model."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """Width of the SwiGLU MLP (per gate/up branch)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); None means multi-head attention (= num_attention_heads)."""
    kv_channels: int | None = None
    """Head dimension; None means hidden_size // num_attention_heads."""
    vocab_size: int = 256
    """Tokenizer vocabulary size before padding."""
    make_vocab_size_divisible_by: int = 64
    """Pad the embedding/output vocabulary up to a multiple of this (1 = no padding)."""
    vocab_padding: VocabPadding = VocabPadding.EARL
    """Padding rule: "earl" (a multiple of make_vocab_size_divisible_by) or "megatron-lm" (a
    multiple of make_vocab_size_divisible_by x vocab_padding_tp, as Megatron-LM pads)."""
    vocab_padding_tp: int | None = None
    """"megatron-lm" padding only (required there): the tensor-parallel size of the Megatron-LM
    run whose vocabulary to match; the shape stays the same in every layout here."""
    max_position_embeddings: int = 4096
    """Longest sequence RoPE is prepared for (rotary tables grow on demand beyond it)."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_type: str = "default"
    """RoPE variant: "default", "linear" (position interpolation), "llama3" (Llama 3.x), "yarn"."""
    rope_scaling_factor: float | None = None
    """Context extension factor (>= 1) of linear, llama3 and yarn; required by them."""
    rope_original_max_position_embeddings: int | None = None
    """Pre-training context of llama3 (None = 8192) and yarn (required)."""
    rope_low_freq_factor: float | None = None
    """llama3: wavelengths above original / this are divided by the factor (None = 1)."""
    rope_high_freq_factor: float | None = None
    """llama3: wavelengths below original / this are kept (None = 4)."""
    yarn_beta_fast: float | None = None
    """yarn: rotations bounding the extrapolated dimensions (None = 32)."""
    yarn_beta_slow: float | None = None
    """yarn: rotations bounding the interpolated dimensions (None = 1)."""
    yarn_mscale: float | None = None
    """yarn: attention factor numerator scale, with yarn_mscale_all_dim (both or neither; None =
    the factor's default 0.1 ln(factor) + 1)."""
    yarn_mscale_all_dim: float | None = None
    """yarn: attention factor denominator scale (set together with yarn_mscale)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    add_qkv_bias: bool = False
    """Bias on the fused QKV projection (Qwen2/2.5)."""
    qk_layernorm: bool = False
    """RMSNorm on per-head queries and keys (Qwen3)."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer weights."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of weights."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP outputs."""
    params_dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    recompute_granularity: str | None = None
    """None, "full" or "selective" activation recompute."""
    recompute_num_layers: int = 1
    """Layers per recompute block when recompute_granularity == "full" (uniform method)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism in every layout with tp > 1 (off at tp = 1, as Megatron-LM
    does): the norms, residuals and dropouts hold 1/tp of the sequence per TP rank (activation
    memory), all-gathered before and reduce-scattered after the tensor-parallel blocks. Packed
    micro-batches are padded at their end so each rank's share divides by tp
    (``parallel.cp.sequence_parallel_padding``)."""
    transformer_impl: TransformerImpl = TransformerImpl.AUTO
    """Layer implementation: "auto" (Transformer Engine when importable on CUDA, unless the rollout
    engine is the embedded one; else local), "local" or "transformer_engine"."""
    attention_backend: str = "sdpa"
    """Core attention of the local implementation: "sdpa" (SDPAttention) or "local" (Megatron's
    DotProductAttention, no packed sequences or CP); Transformer Engine brings its own."""
    cp_comm_type: str | None = None
    """Transformer Engine's context-parallel communication when cp > 1: "p2p", "all_gather", "a2a"
    or "a2a+p2p"; None = "p2p". Needs Transformer Engine (the local CP attention all-gathers)."""
    num_experts: int | None = None
    """Routed experts of every layer's MLP (a mixture of experts, megatron-core's ``MoELayer``);
    None or 0: a dense SwiGLU MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to (1 <= topk <= num_experts)."""
    moe_ffn_hidden_size: int | None = None
    """Width of each routed expert's SwiGLU MLP; None means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total width of the shared experts every token also passes through (Qwen2-MoE, DeepSeek);
    None: no shared expert."""
    moe_router_score_function: str = "softmax"
    """Router scores: "softmax" or "sigmoid" (DeepSeek-V3; needed by the expert bias)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """Load balancing: "aux_loss" (per micro-batch), "seq_aux_loss" (per sequence),
    "global_aux_loss" (global batch), "sinkhorn" or "none"."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss in the training loss (>= 0; 1e-2 is a common start)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss (>= 0; None: no z-loss; 1e-3 is a common start)."""
    moe_expert_capacity_factor: float | None = None
    """Tokens an expert takes, as a factor of its even share (> 0); tokens beyond are dropped by
    moe_token_drop_policy. None: no capacity, no token is dropped."""
    moe_token_drop_policy: str = "probs"
    """With a capacity: drop the tokens of lowest router probability ("probs") or the last ones
    ("position")."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k
    choice, moved after every optimizer step towards balanced load; needs sigmoid scores."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert bias update (> 0)."""
    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach their experts: "alltoall" (any token counts per rank) or "allgather"
    (equal token counts on the ep x etp ranks; packed micro-batches differ between data-parallel
    ranks, so only when those ranks sit inside one tensor-parallel group)."""
    moe_grouped_gemm: bool = True
    """Run a rank's experts as one grouped GEMM (Transformer Engine's ``TEGroupedMLP``) where the
    Transformer Engine spec is used; the local spec (CPU) always runs megatron-core's
    ``SequentialMLP`` (one GEMM per expert), whatever this says."""

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "vocab_size",
            "make_vocab_size_divisible_by",
            "max_position_embeddings",
        )
        bad = {k: getattr(self, k) for k in positive if getattr(self, k) < 1}
        if bad:
            raise ModelConfigError(f"model config values must be >= 1, got {bad}")
        heads, groups = self.num_attention_heads, self.query_groups
        if heads % groups:
            raise ModelConfigError(
                f"num_attention_heads ({heads}) must be divisible by num_query_groups ({groups})"
            )
        if self.kv_channels is None and self.hidden_size % heads:
            raise ModelConfigError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({heads}) unless kv_channels is set"
            )
        if self.params_dtype not in _DTYPES:
            raise ModelConfigError(
                f"params_dtype {self.params_dtype!r} is not one of {sorted(_DTYPES)}"
            )
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ModelConfigError(
                f"recompute_granularity {self.recompute_granularity!r} is not one of "
                "None, 'full', 'selective'"
            )
        try:
            object.__setattr__(self, "transformer_impl", TransformerImpl(self.transformer_impl))
        except ValueError as err:
            raise ModelConfigError(f"transformer_impl: {err}") from None
        self._check_vocab_padding()
        if self.attention_backend not in ATTENTION_BACKENDS:
            hint = (
                "; Transformer Engine is chosen by model.transformer_impl"
                if self.attention_backend in ("auto", "te")
                else ""
            )
            raise ModelConfigError(
                f"attention_backend {self.attention_backend!r} is not one of "
                f"{', '.join(map(repr, ATTENTION_BACKENDS))}{hint}"
            )
        if self.cp_comm_type is not None and self.cp_comm_type not in CP_COMM_TYPES:
            raise ModelConfigError(
                f"cp_comm_type {self.cp_comm_type!r} is not one of None, "
                f"{', '.join(map(repr, CP_COMM_TYPES))}"
            )
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ModelConfigError(f"{name} ({getattr(self, name)}) must be in [0, 1)")
        self._check_rope()
        self._check_moe()

    def _check_moe(self) -> None:
        """MoE values valid (every problem at once); on a dense model, no MoE field set."""
        if self.num_experts is not None and (not _is_int(self.num_experts) or self.num_experts < 0):
            raise ModelConfigError(
                f"num_experts ({self.num_experts}) must be None, 0 (a dense model) or >= 1"
            )
        if not self.is_moe:
            stray = {k: getattr(self, k) for k, v in _MOE_DEFAULTS.items() if getattr(self, k) != v}
            if stray:
                raise ModelConfigError(
                    f"{', '.join(f'{k}={v!r}' for k, v in stray.items())} set on a dense model "
                    f"(num_experts={self.num_experts}): set num_experts, or leave them unset"
                )
            return
        problems = []
        n, k = self.num_experts, self.moe_router_topk
        if not _is_int(k) or not 1 <= k <= n:
            problems.append(f"moe_router_topk ({k}) must be in [1, num_experts ({n})]")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                problems.append(f"{name} ({value}) must be None or >= 1")
        choices = (
            ("moe_router_score_function", MOE_SCORE_FUNCTIONS),
            ("moe_router_load_balancing_type", MOE_LOAD_BALANCING_TYPES),
            ("moe_token_drop_policy", MOE_DROP_POLICIES),
            ("moe_token_dispatcher_type", MOE_DISPATCHERS),
        )
        for name, valid in choices:
            if getattr(self, name) not in valid:
                problems.append(
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(map(repr, valid))}"
                )
        if not self.moe_aux_loss_coeff >= 0:
            problems.append(f"moe_aux_loss_coeff ({self.moe_aux_loss_coeff}) must be >= 0")
        if self.moe_z_loss_coeff is not None and not self.moe_z_loss_coeff >= 0:
            problems.append(f"moe_z_loss_coeff ({self.moe_z_loss_coeff}) must be None or >= 0")
        if not self.moe_router_bias_update_rate > 0:
            problems.append(
                f"moe_router_bias_update_rate ({self.moe_router_bias_update_rate}) must be > 0"
            )
        capacity = self.moe_expert_capacity_factor
        if capacity is not None and not capacity > 0:
            problems.append(f"moe_expert_capacity_factor ({capacity}) must be None or > 0")
        if capacity is not None and self.moe_router_load_balancing_type == "sinkhorn":
            problems.append(
                f"moe_expert_capacity_factor ({capacity}) does not work with "
                "moe_router_load_balancing_type 'sinkhorn' (megatron-core: aux_loss, "
                "seq_aux_loss, global_aux_loss or none)"
            )
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            problems.append(
                "moe_router_enable_expert_bias needs moe_router_score_function 'sigmoid' (got "
                f"{self.moe_router_score_function!r})"
            )
        if (
            k == 1
            and self.moe_router_score_function == "softmax"
            and (self.moe_router_load_balancing_type != "sinkhorn")
        ):
            problems.append(
                "moe_router_topk 1 with softmax scores has a zero router gradient (softmax over "
                "one expert) unless the softmax comes before the top-k, which is not supported "
                "here: use moe_router_topk >= 2 or moe_router_score_function 'sigmoid'"
            )
        if problems:
            raise ModelConfigError(f"MoE settings (num_experts={n}): " + "; ".join(problems))

    def _check_vocab_padding(self) -> None:
        try:
            object.__setattr__(self, "vocab_padding", VocabPadding(self.vocab_padding))
        except ValueError as err:
            raise ModelConfigError(f"vocab_padding: {err}") from None
        tp = self.vocab_padding_tp
        if self.vocab_padding == VocabPadding.MEGATRON_LM and (tp is None or tp < 1):
            raise ModelConfigError(
                f"vocab_padding 'megatron-lm' pads to make_vocab_size_divisible_by x the TP of the "
                f"Megatron-LM run: set vocab_padding_tp to that TP (>= 1), got {tp}"
            )
        if self.vocab_padding == VocabPadding.EARL and tp is not None:
            raise ModelConfigError(
                f"vocab_padding_tp ({tp}) is read by vocab_padding 'megatron-lm' only (it is "
                "'earl'): set it to null, or vocab_padding to megatron-lm"
            )

    def _check_rope(self) -> None:
        """``rope_type`` known, its required fields set, no field of another type set; fills the
        type's defaults (so ``to_dict`` and the HF export carry the values the model uses)."""
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope_type {self.rope_type!r} is not supported; supported: "
                f"{', '.join(map(repr, ROPE_TYPES))}"
            )
        used = ROPE_SCALING_FIELDS[self.rope_type]
        all_fields = dict.fromkeys(f for names in ROPE_SCALING_FIELDS.values() for f in names)
        stray = {f: getattr(self, f) for f in all_fields if f not in used}
        stray = {f: v for f, v in stray.items() if v is not None}
        if stray:
            raise ModelConfigError(
                f"{', '.join(f'{k}={v}' for k, v in stray.items())} conflicts with rope_type="
                f"{self.rope_type!r}, which reads only {list(used) or 'no scaling field'}"
            )
        for name, value in _ROPE_DEFAULTS.get(self.rope_type, {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        missing = [f for f in used if getattr(self, f) is None and not f.startswith("yarn_mscale")]
        if missing:
            raise ModelConfigError(f"rope_type={self.rope_type!r} requires {missing} to be set")
        if self.rope_type != "default" and not self.rope_scaling_factor >= 1.0:
            raise ModelConfigError(
                f"rope_scaling_factor ({self.rope_scaling_factor}) must be >= 1 for rope_type="
                f"{self.rope_type!r}"
            )
        if self.rope_type == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ModelConfigError(
                f"rope_low_freq_factor ({self.rope_low_freq_factor}) must be > 0 and < "
                f"rope_high_freq_factor ({self.rope_high_freq_factor})"
            )
        if self.rope_type == "yarn" and (self.yarn_mscale is None) != (
            self.yarn_mscale_all_dim is None
        ):
            raise ModelConfigError(
                f"yarn_mscale ({self.yarn_mscale}) and yarn_mscale_all_dim "
                f"({self.yarn_mscale_all_dim}) are set together or not at all"
            )
        if self.rope_type == "yarn" and 0 in (self.yarn_mscale, self.yarn_mscale_all_dim):
            raise ModelConfigError(
                f"yarn_mscale ({self.yarn_mscale}) and yarn_mscale_all_dim "
                f"({self.yarn_mscale_all_dim}) must be non-zero (HF reads 0 as unset)"
            )
        if (self.rope_original_max_position_embeddings or 1) < 1:
            raise ModelConfigError(
                "rope_original_max_position_embeddings "
                f"({self.rope_original_max_position_embeddings}) must be >= 1"
            )

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts (``num_experts`` >= 1)."""
        return bool(self.num_experts)

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Width of one routed expert's MLP (``moe_ffn_hidden_size``, else ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, self.vocab_padding_tp or 1
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.params_dtype)

    def num_parameters(self) -> int:
        """Parameter count of the built model (padded vocabulary included)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        qkv_out = (self.num_attention_heads + 2 * self.query_groups) * d
        attn = h * qkv_out + self.num_attention_heads * d * h
        attn += qkv_out if self.add_qkv_bias else 0
        attn += 2 * d if self.qk_layernorm else 0
        mlp = 3 * h * f
        if self.is_moe:  # router, routed experts, shared experts
            shared = self.moe_shared_expert_intermediate_size or 0
            mlp = h * self.num_experts + self.num_experts * 3 * h * self.expert_ffn_hidden_size
            mlp += 3 * h * shared
        layer = attn + mlp + 2 * h
        emb = self.padded_vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h

    def validate_for_parallel(
        self,
        tp: int,
        pp: int = 1,
        cp: int = 1,
        vpp: int | None = None,
        ep: int = 1,
        etp: int | None = None,
    ) -> None:
        """Raise ``ModelConfigError`` if this model cannot be split with the given sizes
        (``etp``: expert tensor parallelism, None = tp, as megatron-core)."""
        problems = self._expert_problems(tp, cp, ep, etp)
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads ({self.num_attention_heads}) % tp ({tp}) != 0")
        if self.query_groups % tp:
            problems.append(f"num_query_groups ({self.query_groups}) % tp ({tp}) != 0")
        if self.ffn_hidden_size % tp:
            problems.append(f"ffn_hidden_size ({self.ffn_hidden_size}) % tp ({tp}) != 0")
        if self.padded_vocab_size % tp:
            problems.append(
                f"padded vocab ({self.padded_vocab_size} = vocab_size {self.vocab_size} padded to "
                f"a multiple of {self.vocab_multiple_text()}) % tp ({tp}) != 0; set "
                f"make_vocab_size_divisible_by to a multiple of {tp}"
            )
        chunks = pp * (vpp or 1)
        if self.num_layers % chunks:
            problems.append(f"num_layers ({self.num_layers}) % (pp ({pp}) x vpp ({vpp or 1})) != 0")
        if problems:
            raise ModelConfigError("model does not fit the parallel layout: " + "; ".join(problems))

    def _expert_problems(self, tp: int, cp: int, ep: int, etp: int | None) -> list[str]:
        """Expert-parallel divisibility (experts by ep, expert FFN by etp, shared FFN by tp) and
        megatron-core's MoE rules that depend on the sizes."""
        etp = None if etp == tp else etp
        if not self.is_moe:
            given = [f"ep ({ep}) > 1"] if ep > 1 else []
            given += [f"etp ({etp}) set"] if etp is not None else []
            if given:
                return [
                    f"{' and '.join(given)} but the model is dense (num_experts="
                    f"{self.num_experts}): expert parallelism needs experts; use ep 1 and no etp, "
                    "or set num_experts"
                ]
            return []
        problems = []
        etp = etp or tp
        if self.num_experts % ep:
            problems.append(f"num_experts ({self.num_experts}) % ep ({ep}) != 0")
        if self.expert_ffn_hidden_size % etp:
            problems.append(
                f"moe_ffn_hidden_size ({self.expert_ffn_hidden_size}) % etp ({etp}) != 0"
            )
        shared = self.moe_shared_expert_intermediate_size
        if shared and shared % tp:
            problems.append(f"moe_shared_expert_intermediate_size ({shared}) % tp ({tp}) != 0")
        if tp > 1 and not self.sequence_parallel:
            problems.append(
                f"tp ({tp}) > 1 with experts needs sequence_parallel: true (megatron-core's "
                "MoELayer refuses to train tensor-parallel without it)"
            )
        if self.moe_token_dispatcher_type == "allgather" and (tp * cp) % (ep * etp):
            problems.append(
                f"moe_token_dispatcher_type 'allgather' gathers over the ep x etp ({ep} x {etp}) "
                f"ranks, which here span data-parallel ranks (tp x cp = {tp * cp}), whose packed "
                "micro-batches hold different token counts: use 'alltoall'"
            )
        return problems

    def vocab_multiple_text(self) -> str:
        """What the vocabulary is padded to a multiple of, in words (for messages)."""
        text = f"make_vocab_size_divisible_by {self.make_vocab_size_divisible_by}"
        if self.vocab_padding == VocabPadding.MEGATRON_LM:
            text += f" x vocab_padding_tp {self.vocab_padding_tp} (Megatron-LM's rule)"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Plain values (vocabulary members as their strings): YAML/JSON safe."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return out | {
            "transformer_impl": self.transformer_impl.value,
            "vocab_padding": self.vocab_padding.value,
        }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by`` x ``tp``: Megatron-LM's rule
    (``_vocab_size_with_padding``) at TP ``tp``; this project's "earl" rule is ``tp`` = 1."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def sequence_parallel_size(model: ModelConfig, tp: int) -> int:
    """How many ranks split the sequence of ``model`` built at ``tp``: tp under sequence
    parallelism, else 1 (the ``sp`` of ``training.microbatch.thd_micro_batch``)."""
    return tp if model.sequence_parallel and tp > 1 else 1


def build_transformer_config(
    model: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    use_cpu_initialization: bool | None = None,
    batch_p2p_comm: bool | None = None,
    grouped_gemm: bool = False,
) -> TransformerConfig:
    """The one function that builds Megatron's ``TransformerConfig`` for this project.

    ``use_cpu_initialization`` and ``batch_p2p_comm`` default to what this machine has (CUDA or
    not); ``models.gpt.build_model`` passes the device policy's answers, and ``grouped_gemm``:
    whether the experts are Transformer Engine's grouped GEMM (the TE spec with
    ``model.moe_grouped_gemm``)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    model.validate_for_parallel(tp=tp, pp=pp, cp=cp, vpp=vpp, ep=ep, etp=etp)
    on_cpu = not torch.cuda.is_available()
    dtype = model.torch_dtype
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        cp_comm_type=model.cp_comm_type or "p2p",
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=model.sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu if use_cpu_initialization is None else use_cpu_initialization,
        recompute_granularity=model.recompute_granularity,
        recompute_method="uniform" if model.recompute_granularity == "full" else None,
        recompute_num_layers=(
            model.recompute_num_layers if model.recompute_granularity == "full" else None
        ),
        # Gloo pairs batched p2p ops in the wrong order when the previous and next pipeline
        # stages are the same rank (interleaved PP=2): silently wrong gradients. Unbatched p2p is
        # correct on every backend.
        batch_p2p_comm=not on_cpu if batch_p2p_comm is None else batch_p2p_comm,
        deallocate_pipeline_outputs=True,
        **_moe_kwargs(model, ep=ep, etp=etp or tp, grouped_gemm=grouped_gemm),
    )
    if model.rope_type == "yarn":
        # GPTModel, YarnRotaryEmbedding and Attention (its mscale) read these attributes, which
        # TransformerConfig does not declare (Megatron-LM sets them from its --yarn-* args too).
        yarn = {
            "yarn_rotary_scaling_factor": model.rope_scaling_factor,
            "yarn_original_max_position_embeddings": model.rope_original_max_position_embeddings,
            "yarn_beta_fast": model.yarn_beta_fast,
            "yarn_beta_slow": model.yarn_beta_slow,
            # Unset = Megatron's (1, 0): attention factor 0.1 ln(factor) + 1, as HF's default.
            "yarn_mscale": 1.0 if model.yarn_mscale is None else model.yarn_mscale,
            "yarn_mscale_all_dim": model.yarn_mscale_all_dim or 0.0,
            "yarn_correction_range_round_to_int": True,
        }
        for name, value in yarn.items():
            setattr(config, name, value)
    return config


def _moe_kwargs(model: ModelConfig, *, ep: int, etp: int, grouped_gemm: bool) -> dict[str, Any]:
    """``TransformerConfig`` arguments of the mixture of experts (none for a dense model, whose
    config stays what it was before MoE existed here)."""
    if not model.is_moe:
        return {}
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_ffn_hidden_size": model.expert_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "moe_router_score_function": model.moe_router_score_function,
        "moe_router_load_balancing_type": model.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": model.moe_aux_loss_coeff,
        "moe_z_loss_coeff": model.moe_z_loss_coeff,
        "moe_expert_capacity_factor": model.moe_expert_capacity_factor,
        "moe_token_drop_policy": model.moe_token_drop_policy,
        "moe_router_enable_expert_bias": model.moe_router_enable_expert_bias,
        "moe_router_bias_update_rate": model.moe_router_bias_update_rate,
        "moe_token_dispatcher_type": model.moe_token_dispatcher_type,
        "moe_grouped_gemm": grouped_gemm,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        # every router holds a RouterReplay (native routing until an action is set): the engine
        # records routes through it and the trainer replays them (models.routing)
        "moe_enable_routing_replay": True,
    }
