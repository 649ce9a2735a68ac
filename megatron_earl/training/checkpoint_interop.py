"""Megatron-LM interop of training checkpoints: what Megatron-LM's loader reads, written by
``training/checkpoint.py``, and the checks both ways.

Megatron-LM's loader (``megatron/training/checkpointing.py``, core_v0.16.1) finds a torch_dist
checkpoint through ``<load>/latest_checkpointed_iteration.txt`` (an iteration number, or
"release") naming ``<load>/iter_NNNNNNN/`` (or ``release/``); reads ``common.pt``
(``dist_checkpointing.load_common_state_dict``) for ``args`` (an ``argparse.Namespace``),
``iteration`` and ``checkpoint_version`` (3.0); compares ``num_layers``, ``hidden_size``,
``num_attention_heads`` and ``add_position_embedding`` (with a ``--vocab-file`` also
``max_position_embeddings``, ``make_vocab_size_divisible_by``, ``tokenizer_type``) with its own
arguments; loads RNG and optimizer state only when the args' TP/PP equal its own and
``no_save_rng`` / ``no_save_optim`` are false; and loads the model with ``dist_checkpointing.load``
of its ``sharded_state_dict()`` under ``model`` (``model0``, ``model1``, ... with virtual
pipeline stages). It pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` x TP.

Here: those names; the ``args`` this project writes (``megatron_lm_args``: the shape of the built
model, the config's vocabulary and RoPE, the saving layout, ``no_save_optim`` / ``no_save_rng``
true because our optimizer and RNG formats are not Megatron-LM's); the checks (``save_problems``:
the config describes the model being saved; ``load_problems``: a checkpoint's args describe the
model loading it, with the flags that fix a mismatch); the tracker's grammar. Pure: no files, no
collectives.
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from megatron_earl.config.model import ModelConfig, padded_vocab_size
from megatron_earl.config.vocab import VocabPadding

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker file at the save root: the newest iteration, or "release"."""
RELEASE = "release"
"""Megatron-LM's name of a release checkpoint (tracker text and directory)."""
CHECKPOINT_VERSION = 3.0
"""``common.pt["checkpoint_version"]`` as Megatron-LM writes it (QKV ordering of mcore models)."""

SHAPE_KEYS: dict[str, str] = {
    "num_layers": "model.num_layers",
    "hidden_size": "model.hidden_size",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups",
    "kv_channels": "model.kv_channels",
    "add_qkv_bias": "model.add_qkv_bias",
    "qk_layernorm": "model.qk_layernorm",
    "untie_embeddings_and_output_weights": "model.tie_embeddings (its negation)",
}
"""Megatron-LM argument -> the config key that sets it: what must agree for the tensors to fit."""


def model_key(index: int, num_chunks: int) -> str:
    """Megatron-LM's key of model chunk ``index`` in the state dict: ``model`` for one chunk,
    ``model0``, ``model1``, ... for virtual pipeline stages. (Tensors are stored under their own
    layout-independent keys, so this only names the branch of the dict.)"""
    return "model" if num_chunks == 1 else f"model{index}"


def tracker_dir_name(text: str) -> str | None:
    """The directory a tracker's text names (``iter_NNNNNNN`` or ``release``); None if the text
    is neither an iteration number nor "release"."""
    text = text.strip()
    if text == RELEASE:
        return RELEASE
    return f"iter_{int(text):07d}" if text.isdigit() else None


def model_args(chunk: nn.Module) -> dict[str, Any]:
    """The shape of a built (unwrapped) GPTModel chunk in Megatron-LM's argument names; the same
    on every rank (global sizes). Local."""
    c = chunk.config
    groups = c.num_query_groups or c.num_attention_heads
    return {
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "ffn_hidden_size": c.ffn_hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "group_query_attention": groups != c.num_attention_heads,
        "num_query_groups": groups,
        "kv_channels": c.kv_channels,
        "add_qkv_bias": c.add_qkv_bias,
        "qk_layernorm": c.qk_layernorm,
        "untie_embeddings_and_output_weights": not chunk.share_embeddings_and_output_weights,
        "padded_vocab_size": chunk.vocab_size,
        "max_position_embeddings": chunk.max_sequence_length,
        "position_embedding_type": chunk.position_embedding_type,
        "layernorm_epsilon": c.layernorm_epsilon,
        "params_dtype": c.params_dtype,
        "bf16": c.bf16,
        "fp16": c.fp16,
    }


def config_args(model: ModelConfig) -> dict[str, Any]:
    """``model`` in Megatron-LM's argument names (the inverse of the recipe mapping,
    ``config.megatron_args``)."""
    groups = model.query_groups
    out: dict[str, Any] = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "group_query_attention": groups != model.num_attention_heads,
        "num_query_groups": groups,
        "kv_channels": model.head_dim,
        "add_qkv_bias": model.add_qkv_bias,
        "qk_layernorm": model.qk_layernorm,
        "untie_embeddings_and_output_weights": not model.tie_embeddings,
        "vocab_size": model.vocab_size,
        "make_vocab_size_divisible_by": model.make_vocab_size_divisible_by,
        "padded_vocab_size": model.padded_vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "position_embedding_type": "yarn" if model.rope_type == "yarn" else "rope",
        "use_rotary_position_embeddings": True,
        "add_position_embedding": False,  # no learned position embedding (Megatron-LM's RoPE)
        "rotary_base": int(model.rotary_base),
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "use_rope_scaling": model.rope_type == "llama3",
        "normalization": "RMSNorm",
        "layernorm_epsilon": model.norm_epsilon,
        "swiglu": True,
        "add_bias_linear": False,
        "init_method_std": model.init_method_std,
        "attention_dropout": model.attention_dropout,
        "hidden_dropout": model.hidden_dropout,
        "params_dtype": model.torch_dtype,
        "bf16": model.params_dtype == "bfloat16",
        "fp16": model.params_dtype == "float16",
        "sequence_parallel": model.sequence_parallel,
    }
    if model.rope_type == "llama3":
        out["rope_scaling_factor"] = model.rope_scaling_factor
    elif model.rope_type == "linear":
        out["rotary_seq_len_interpolation_factor"] = model.rope_scaling_factor
    elif model.rope_type == "yarn":
        out |= {
            "rotary_scaling_factor": model.rope_scaling_factor,
            "yarn_original_max_position_embeddings": model.rope_original_max_position_embeddings,
            "yarn_beta_fast": model.yarn_beta_fast,
            "yarn_beta_slow": model.yarn_beta_slow,
            "mscale": 1.0 if model.yarn_mscale is None else model.yarn_mscale,
            "mscale_all_dim": model.yarn_mscale_all_dim or 0.0,
        }
    return out


def megatron_lm_args(
    facts: dict[str, Any], model: ModelConfig | None, layout: dict[str, Any], step: int
) -> argparse.Namespace:
    """The ``args`` of ``common.pt``: the built model's shape (``facts``, ``model_args``), the
    config's vocabulary and RoPE (when given), the saving layout (``tp``, ``pp``, ``cp``, ``dp``,
    ``vpp``, ``world_size``) and ``step`` as the iteration."""
    values = {**(config_args(model) if model is not None else {}), **facts}
    values |= {
        "tensor_model_parallel_size": layout["tp"],
        "pipeline_model_parallel_size": layout["pp"],
        "context_parallel_size": layout["cp"],
        "data_parallel_size": layout["dp"],
        "virtual_pipeline_model_parallel_size": layout["vpp"],
        "expert_model_parallel_size": 1,
        "world_size": layout["world_size"],
        "iteration": step,
        "ckpt_format": "torch_dist",
        "use_dist_ckpt": True,
        # Our optimizer and RNG states are not in Megatron-LM's format (no scheduler state,
        # per-rank RNG objects): these make its loader skip them and start them fresh.
        "no_save_optim": True,
        "no_save_rng": True,
        "tokenizer_type": None,  # unknown here (a Megatron-LM run with --vocab-file compares it)
        "data_parallel_random_init": False,
    }
    return argparse.Namespace(**values)


def _ckpt_arg(args: argparse.Namespace, name: str) -> Any:
    """A checkpoint argument as the model uses it (Megatron-LM keeps ``num_query_groups`` = 1
    without ``--group-query-attention``); None when absent."""
    if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return getattr(args, "num_attention_heads", None)
    return getattr(args, name, None)


def save_problems(facts: dict[str, Any], model: ModelConfig | None) -> list[str]:
    """Where the config passed to a save does not describe the model being saved (its args
    would then describe another model); empty when none (or no config)."""
    if model is None:
        return []
    want = config_args(model)
    problems = [
        f"{SHAPE_KEYS[k]}: the config says {want[k]!r}, the model being saved has {facts[k]!r}"
        for k in SHAPE_KEYS
        if want[k] != facts[k]
    ]
    if want["padded_vocab_size"] != facts["padded_vocab_size"]:
        problems.append(
            f"vocabulary: the config pads vocab_size {model.vocab_size} to "
            f"{model.padded_vocab_size} (a multiple of {model.vocab_multiple_text()}), the model "
            f"being saved has {facts['padded_vocab_size']} rows; save with the config the model "
            "was built from (model.vocab_padding, model.vocab_padding_tp, "
            "model.make_vocab_size_divisible_by)"
        )
    return problems


def load_problems(
    args: argparse.Namespace,
    facts: dict[str, Any],
    model: ModelConfig | None = None,
    saved: dict[str, Any] | None = None,
) -> list[str]:
    """Where a checkpoint's ``args`` do not describe the model loading it (``facts``), each
    naming both values and the config key that fixes it. ``model``: the loading run's config
    (names its padding rule); ``saved``: the checkpoint's own ``ModelConfig.to_dict()`` when
    this project wrote it (names the rule it was saved with)."""
    problems = []
    for name, key in SHAPE_KEYS.items():
        theirs = _ckpt_arg(args, name)
        if theirs is not None and theirs != facts[name]:
            problems.append(f"{name}: checkpoint {theirs!r}, this model {facts[name]!r} ({key})")
    rows = getattr(args, "padded_vocab_size", None)
    if rows is not None and rows != facts["padded_vocab_size"]:
        problems.append(_vocab_problem(args, rows, facts["padded_vocab_size"], model, saved))
    return problems


def _vocab_problem(
    args: argparse.Namespace,
    rows: int,
    ours: int,
    model: ModelConfig | None,
    saved: dict[str, Any] | None,
) -> str:
    """The padded vocabularies differ: both sizes, both rules, the settings that give ``rows``."""
    divisor = getattr(args, "make_vocab_size_divisible_by", None)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if saved is not None:  # this project's checkpoint: its config says its rule
        rule = saved.get("vocab_padding", VocabPadding.EARL)
        saved_tp = saved.get("vocab_padding_tp")
        theirs = f"saved with model.vocab_padding={rule}" + (
            f", model.vocab_padding_tp={saved_tp}" if saved_tp else ""
        )
        fix = [f"model.vocab_padding={rule}"]
        fix += [f"model.vocab_padding_tp={saved_tp}"] if saved_tp else []
        fix += [f"model.make_vocab_size_divisible_by={saved['make_vocab_size_divisible_by']}"]
    else:
        theirs = (
            f"Megatron-LM's rule: a multiple of make_vocab_size_divisible_by {divisor} x "
            f"tensor_model_parallel_size {tp}"
        )
        vocab = getattr(args, "vocab_size", None) or (model.vocab_size if model else None)
        if divisor and vocab and padded_vocab_size(vocab, divisor, tp) == rows:
            fix = [
                f"model.vocab_padding={VocabPadding.MEGATRON_LM}",
                f"model.vocab_padding_tp={tp}",
                f"model.make_vocab_size_divisible_by={divisor}",
            ]
        else:
            fix = [f"model.vocab_padding / vocab_padding_tp / vocab_size so they pad to {rows}"]
    mine = (
        f"vocab_size {model.vocab_size} padded to a multiple of {model.vocab_multiple_text()}"
        if model is not None
        else "the model's padded vocabulary"
    )
    return (
        f"vocabulary padding: checkpoint {rows} rows ({theirs}), this model {ours} ({mine}); "
        f"set {' '.join(fix)}"
    )
