"""Drop-in Megatron-LM arguments: our ``earl`` argument group for Megatron-LM's parser, and the
mapping of Megatron-LM's standard arguments onto ``RunConfig``.

With Megatron-LM installed, pass ``add_earl_args`` as its ``extra_args_provider``::

    from megatron.training.arguments import parse_args
    args = parse_args(extra_args_provider=add_earl_args)
    cfg = config_from_megatron_args(args)

With megatron-core only, ``build_parser()`` is a minimal parser that accepts the standard
Megatron-LM flags a pretraining recipe uses (model shape, parallel sizes, optimizer, checkpoint
paths), with Megatron-LM's names and defaults, plus ours, so a recipe's bash arguments work
unchanged::

    args = build_parser().parse_args(sys.argv[1:])
    cfg = config_from_megatron_args(args, world_size=int(os.environ["WORLD_SIZE"]))

Precedence (lowest first): dataclass defaults < ``--earl-config`` YAML < Megatron flags (with
Megatron-LM's defaults for omitted ones) < ``--earl-*`` flags < ``--earl-override key=value``. A key
set by both the YAML and a Megatron flag to different values is an error (say it once).

Every other flag of Megatron-LM's parser is refused or has no effect (``megatron_flag_policy``,
table in megatron_earl/docs/megatron_args.md): a refused flag given (with a value other than
Megatron-LM's default) is an error naming it, why, and what to use instead; no-effect flags that
were given are listed in one log line; a flag Megatron-LM does not have is an error naming the
nearest known one.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
from typing import Any

from megatron_earl.config.loader import config_from_tree, merged_tree, parse_overrides
from megatron_earl.config.megatron_flag_policy import (
    NO_EFFECT_FLAGS,
    REFUSED_FLAGS,
    ROPE_PENDING,
    ROPE_SCALING_FLAGS,
)
from megatron_earl.config.megatron_flags import add_megatron_flags
from megatron_earl.config.run import ConfigError, RunConfig, layout_sizes
from megatron_earl.config.vocab import EngineKind, Phase

logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` and names the nearest known flag for a typo."""

    def error(self, message: str):  # type: ignore[override]
        known = [s for a in self._actions for s in a.option_strings]
        if message.startswith("unrecognized arguments:"):
            refused = [
                arg.split("=")[0]
                for arg in message.split(":", 1)[1].split()
                if refusal(arg.split("=")[0], known) is not None
            ]
            if refused:
                raise ConfigError(
                    "Megatron arguments not supported here:\n  "
                    + "\n  ".join(f"{f}: {refusal(f, known)}" for f in dict.fromkeys(refused))
                )
            hints = []
            for arg in message.split(":", 1)[1].split():
                if arg.startswith("--"):
                    near = difflib.get_close_matches(arg.split("=")[0], known, n=1, cutoff=0.75)
                    hints.append(f"{arg} (did you mean {near[0]}?)" if near else arg)
            if hints:
                message = "unrecognized arguments: " + ", ".join(hints)
        raise ConfigError(f"command line: {message}")


def build_parser() -> argparse.ArgumentParser:
    """A parser for Megatron-LM's standard flags (names and defaults as Megatron-LM's) plus the
    ``earl`` group; use it when Megatron-LM is not installed."""
    parser = _Parser(
        description="megatron-earl trainer (Megatron-LM compatible arguments)", allow_abbrev=False
    )
    add_megatron_flags(parser)
    no_effect = parser.add_argument_group("accepted Megatron-LM flags with no effect here")
    for flag, nargs in NO_EFFECT_FLAGS.items():
        if nargs == 0:
            no_effect.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            no_effect.add_argument(
                flag, nargs=None if nargs == 1 else nargs, help=argparse.SUPPRESS
            )
    return add_earl_args(parser)


def refusal(flag: str, declared: list[str] | None = None) -> str | None:
    """Why ``flag`` is refused here, or None: ``REFUSED_FLAGS``, and the RoPE-scaling flags
    while they are not among ``declared`` (the option strings of the parser in use; None: the
    mapped flags, ``add_megatron_flags``)."""
    if flag in REFUSED_FLAGS:
        return REFUSED_FLAGS[flag]
    if flag in ROPE_SCALING_FLAGS and flag not in (
        _mapped_flags() if declared is None else declared
    ):
        return ROPE_PENDING
    return None


def _mapped_flags() -> set[str]:
    """Option strings ``add_megatron_flags`` declares (the mapped flags)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_megatron_flags(parser)
    return {s for a in parser._actions for s in a.option_strings}


def add_earl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: add the ``earl`` group; returns the parser."""
    group = parser.add_argument_group(title="earl", description="megatron-earl RL post-training")
    group.add_argument("--earl-config", default=None, help="YAML run config (configs/*.yaml)")
    group.add_argument(
        "--earl-override",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="dotted config overrides applied last, e.g. train.loss.kl_coef=0.01",
    )
    for phase in (Phase.ROLLOUT, Phase.EXPERIENCE):
        group.add_argument(
            f"--earl-{phase}-layout",
            default=None,
            help=f"{phase} layout, e.g. tp4cp1pp1dp2 (default: the training layout)",
        )
    group.add_argument("--earl-env", default=None, help="environment name or pkg.module:Class")
    group.add_argument("--earl-engine", default=None, choices=tuple(EngineKind))
    group.add_argument("--earl-engine-urls", nargs="+", default=None, help="SGLang server URLs")
    group.add_argument("--earl-max-turns", type=int, default=None, help="model turns per episode")
    group.add_argument("--earl-prompts-per-step", type=int, default=None)
    group.add_argument("--earl-samples-per-prompt", type=int, default=None)
    group.add_argument("--earl-output-dir", default=None, help="parent of run directories")
    group.add_argument("--earl-run-name", default=None, help="run directory name")
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            action.__class__ = _recording(type(action))
    return parser


GIVEN = "earl_given_flags"
"""Namespace attribute: the flags given on the command line with a value other than their
default, as parsed (before Megatron-LM's ``validate_args`` derives other arguments from them)."""


PRESENT = "earl_present_flags"
"""Namespace attribute: every flag on the command line, whatever its value (a conflict such as
``--rope-scaling-factor 8.0`` without ``--use-rope-scaling`` is told even at the default)."""


def _recording(cls: type[argparse.Action]) -> type[argparse.Action]:
    """``cls`` that also notes its flag in ``namespace.earl_given_flags`` when the parsed value
    differs from the default, so refused and no-effect flags are told given after parsing, with
    Megatron-LM's parser as with ours, and in ``namespace.earl_present_flags`` always."""
    if getattr(cls, "_earl_recording", False):
        return cls

    def __call__(self, parser, namespace, values, option_string=None):
        cls.__call__(self, parser, namespace, values, option_string)
        if getattr(namespace, PRESENT, None) is None:
            setattr(namespace, PRESENT, [])
        getattr(namespace, PRESENT).append(self.option_strings[0])
        if getattr(namespace, self.dest, None) != self.default:
            if getattr(namespace, GIVEN, None) is None:
                setattr(namespace, GIVEN, [])
            getattr(namespace, GIVEN).append(self.option_strings[0])

    return type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__, "_earl_recording": True})


def config_from_megatron_args(args: argparse.Namespace, world_size: int | None = None) -> RunConfig:
    """The ``RunConfig`` described by parsed Megatron-LM + earl arguments (see module docstring).

    ``world_size`` (for the data-parallel size of the training layout): the argument, else
    ``args.world_size`` (Megatron-LM sets it), else the ``WORLD_SIZE`` environment variable, else 1.
    """
    if world_size is None:
        world_size = getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
    given = _given_flags(args)
    refused = [(f, refusal(f)) for f in given if refusal(f) is not None]
    if refused:
        raise ConfigError(
            "Megatron arguments not supported here:\n  "
            + "\n  ".join(f"{flag}: {why}" for flag, why in refused)
        )
    no_effect = [f for f in given if f in NO_EFFECT_FLAGS]
    if no_effect:
        logger.warning(
            "Megatron-LM flags accepted with no effect here (docs/megatron_args.md): %s",
            " ".join(no_effect),
        )
    yaml_tree = merged_tree(args.earl_config)
    megatron = _megatron_tree(args, world_size)
    conflicts = [
        f"{key}: {yaml_value!r} in {args.earl_config} but {megatron[key]!r} from the Megatron "
        "arguments"
        for key, yaml_value in _flatten(yaml_tree).items()
        if key in megatron and not _same(key, megatron[key], yaml_value)
    ]
    if conflicts:
        raise ConfigError(
            "the YAML config and the Megatron arguments disagree (set each once):\n  "
            + "\n  ".join(conflicts)
        )
    flat = {**megatron, **_earl_tree(args)}
    for phase in (Phase.ROLLOUT, Phase.EXPERIENCE):  # default: the training layout
        if f"layouts.{phase}" not in flat and phase not in (yaml_tree.get("layouts") or {}):
            flat[f"layouts.{phase}"] = megatron["layouts.train"]
    tree = _deep_merge(yaml_tree, _unflatten(flat))
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.create(tree), parse_overrides(args.earl_override))
    return config_from_tree(OmegaConf.to_container(merged, resolve=True))


def _given_flags(args: argparse.Namespace) -> list[str]:
    """The flags given with a non-default value (recorded while parsing, ``_recording``), by
    their first option string, each once."""
    return list(dict.fromkeys(getattr(args, GIVEN, None) or []))


def _conflicts(args: argparse.Namespace) -> list[str]:
    """Pairs of flags that contradict each other, each message naming both."""
    out = []
    if args.bf16 and args.fp16:
        out.append("--bf16 and --fp16 both given: choose one precision")
    if args.lr_warmup_iters and args.lr_warmup_fraction is not None:
        out.append(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) and --lr-warmup-fraction "
            f"({args.lr_warmup_fraction}) both given: choose one"
        )
    if not args.group_query_attention and args.num_query_groups != 1:
        out.append(
            f"--num-query-groups {args.num_query_groups} without --group-query-attention: "
            "Megatron-LM would build multi-head attention; add --group-query-attention"
        )
    if args.lr_decay_style != "WSD" and args.lr_wsd_decay_iters is not None:
        out.append(
            f"--lr-wsd-decay-iters ({args.lr_wsd_decay_iters}) without --lr-decay-style WSD "
            f"(it is {args.lr_decay_style})"
        )
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        out.append("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.optimizer != "sgd" and args.sgd_momentum != 0.9:
        out.append(f"--sgd-momentum {args.sgd_momentum} with --optimizer {args.optimizer}")
    if args.recompute_method == "block":
        out.append(
            "--recompute-method block: only uniform recompute is built here "
            "(use --recompute-method uniform)"
        )
    if args.recompute_method is not None and args.recompute_granularity != "full":
        out.append(
            f"--recompute-method {args.recompute_method} without --recompute-granularity full"
        )
    return out


def _megatron_tree(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """Dotted ``RunConfig`` keys from Megatron-LM's standard arguments."""
    problems = _conflicts(args)
    if args.normalization != "RMSNorm":
        problems.append(f"--normalization {args.normalization}: only RMSNorm models are supported")
    if not args.swiglu:
        problems.append("--swiglu is required: the models are SwiGLU (Llama/Qwen family)")
    if args.add_bias_linear:
        problems.append("--disable-bias-linear is required: linear layers have no bias here")
    rope = args.position_embedding_type in ("rope", "yarn") or getattr(
        args, "use_rotary_position_embeddings", False
    )
    if not rope:
        problems.append(
            f"--position-embedding-type {args.position_embedding_type}: only rope or yarn"
        )
    rope_tree, rope_problems = _rope_tree(args)
    problems += rope_problems
    moe_tree, moe_problems = _moe_tree(args)
    problems += moe_problems
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, flag) is None:
            problems.append(f"--{flag.replace('_', '-')} is required")
    if args.vocab_size is None:
        problems.append("--vocab-size is required (no Megatron tokenizer is built here)")
    tp = args.tensor_model_parallel_size
    cp = args.context_parallel_size
    pp = args.pipeline_model_parallel_size
    if not problems and world_size % (tp * cp * pp):
        problems.append(
            f"world size ({world_size}) is not divisible by tp ({tp}) x cp ({cp}) x pp ({pp})"
        )
    if problems:
        raise ConfigError("Megatron arguments: " + "; ".join(problems))
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp is None:
        vpp = args.num_virtual_stages_per_pipeline_rank
    if vpp is None and args.num_layers_per_virtual_pipeline_stage:
        vpp = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
    dp = world_size // (tp * cp * pp)
    layout = f"tp{tp}cp{cp}pp{pp}" + (f"vpp{vpp}" if vpp else "") + f"dp{dp}"
    ep, etp = getattr(args, "expert_model_parallel_size", 1), args.expert_tensor_parallel_size
    layout += (f"ep{ep}" if ep != 1 else "") + (f"etp{etp}" if etp not in (None, tp) else "")
    ffn = args.ffn_hidden_size
    if ffn is None:  # Megatron-LM's default for SwiGLU
        ffn = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    tree = {
        "model.num_layers": args.num_layers,
        "model.hidden_size": args.hidden_size,
        "model.ffn_hidden_size": ffn,
        "model.num_attention_heads": args.num_attention_heads,
        "model.num_query_groups": args.num_query_groups if args.group_query_attention else None,
        "model.kv_channels": args.kv_channels,
        "model.vocab_size": args.vocab_size,
        "model.make_vocab_size_divisible_by": args.make_vocab_size_divisible_by,
        # Megatron-LM pads to the divisor x its TP: the same vocabulary (and checkpoints) as the
        # recipe's Megatron-LM run, in every layout here.
        "model.vocab_padding": "megatron-lm",
        "model.vocab_padding_tp": tp,
        "model.max_position_embeddings": args.max_position_embeddings or args.seq_length,
        "model.rotary_base": float(args.rotary_base),
        **rope_tree,
        **moe_tree,
        "model.norm_epsilon": args.layernorm_epsilon,
        "model.add_qkv_bias": args.add_qkv_bias,
        "model.qk_layernorm": args.qk_layernorm,
        "model.tie_embeddings": not args.untie_embeddings_and_output_weights,
        "model.init_method_std": args.init_method_std,
        "model.attention_dropout": args.attention_dropout,
        "model.hidden_dropout": args.hidden_dropout,
        "model.params_dtype": dtype,
        "model.transformer_impl": "local" if args.transformer_impl == "local" else "auto",
        "model.recompute_granularity": args.recompute_granularity,
        "model.recompute_num_layers": args.recompute_num_layers or 1,
        "model.sequence_parallel": args.sequence_parallel,
        "layouts.train": layout,
        "seed": args.seed,
        "train.lr": args.lr,
        "train.min_lr": args.min_lr,
        "train.weight_decay": args.weight_decay,
        "train.adam_beta1": args.adam_beta1,
        "train.adam_beta2": args.adam_beta2,
        "train.adam_eps": args.adam_eps,
        "train.clip_grad": args.clip_grad,
        "train.use_distributed_optimizer": args.use_distributed_optimizer,
        "train.optimizer": args.optimizer,
        "train.sgd_momentum": args.sgd_momentum,
        "train.lr_decay_style": args.lr_decay_style,
        "train.lr_decay_steps": args.lr_decay_iters,
        "train.lr_warmup_steps": args.lr_warmup_iters,
        "train.lr_warmup_fraction": args.lr_warmup_fraction,
        "train.lr_warmup_init": args.lr_warmup_init,
        "train.lr_wsd_decay_style": args.lr_wsd_decay_style,
        "train.lr_wsd_decay_steps": args.lr_wsd_decay_iters,
        "rollout.max_context": args.seq_length,
        "steps": args.train_iters,
        "checkpoint.load": args.load,
        "checkpoint.dir": args.save,
        "checkpoint.interval": args.save_interval,
        "logging.tensorboard_dir": args.tensorboard_dir,
        "runtime.collective_timeout_s": _collective_timeout_s(args),
    }
    # An omitted flag whose Megatron-LM default is None leaves the YAML/default value alone;
    # num_query_groups=None is meaningful (no --group-query-attention: multi-head attention).
    return {k: v for k, v in tree.items() if v is not None or k == "model.num_query_groups"}


def _collective_timeout_s(args: argparse.Namespace) -> float | None:
    """``--distributed-timeout-minutes`` in seconds when given; omitted, None (the run's own
    ``runtime.collective_timeout_s`` default stands, not Megatron-LM's 10 minutes)."""
    if "--distributed-timeout-minutes" not in (getattr(args, PRESENT, None) or []):
        return None
    minutes = args.distributed_timeout_minutes
    if minutes <= 0:
        raise ConfigError(
            f"--distributed-timeout-minutes {minutes}: must be > 0 (minutes a collective may "
            "wait before the run fails)"
        )
    return 60.0 * minutes


_YARN_FLAGS = {  # flag -> its value when omitted (Megatron-LM's)
    "--rotary-scaling-factor": 1.0,
    "--yarn-original-max-position-embeddings": None,
    "--yarn-beta-fast": None,
    "--yarn-beta-slow": None,
    "--mscale": 1.0,
    "--mscale-all-dim": 0.0,
}


def _rope_tree(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """``model.rope_*`` / ``model.yarn_*`` keys from Megatron-LM's RoPE flags, and the problems:
    ``--use-rope-scaling`` [``--rope-scaling-factor``] is llama3 (Llama 3.1's 1/4/8192, as
    Megatron-Core), ``--rotary-seq-len-interpolation-factor`` linear, ``--position-embedding-type
    yarn`` with ``--rotary-scaling-factor`` / ``--yarn-*`` / ``--mscale*`` YaRN (Megatron-LM's
    ``_apply_yarn_config_from_args``). A flag of one type given with another names both."""
    problems = []
    yarn = args.position_embedding_type == "yarn"
    linear = args.rotary_seq_len_interpolation_factor
    # getattr: a Megatron-LM parser older than its YaRN flags lacks them (omitted, then).
    given_yarn = [
        f for f, omitted in _YARN_FLAGS.items() if getattr(args, _dest(f), omitted) != omitted
    ]
    round_to_int = getattr(args, "yarn_correction_range_round_to_int", None)
    if round_to_int is not None:
        given_yarn.append(f"--{'' if round_to_int else 'no-'}yarn-correction-range-round-to-int")
    kinds = {
        "--use-rope-scaling": args.use_rope_scaling,
        "--rotary-seq-len-interpolation-factor": linear is not None,
        "--position-embedding-type yarn": yarn,
    }
    chosen = [k for k, on in kinds.items() if on]
    if len(chosen) > 1:
        problems.append(f"{' and '.join(chosen)} are different RoPE scalings; give one")
    factor_given = args.rope_scaling_factor != 8.0 or "--rope-scaling-factor" in (
        getattr(args, PRESENT, None) or []
    )  # 8.0: Megatron-LM's default, told given by the recording parser
    if factor_given and not args.use_rope_scaling:
        problems.append(
            f"--rope-scaling-factor {args.rope_scaling_factor} is given without "
            "--use-rope-scaling (it needs it)"
        )
    if given_yarn and not yarn:
        problems.append(
            f"{', '.join(given_yarn)} given without --position-embedding-type yarn (YaRN only)"
        )
    if args.rotary_percent != 1.0:
        problems.append(
            f"--rotary-percent {args.rotary_percent}: partial rotary embeddings are not "
            "supported (only 1.0)"
        )
    if yarn and round_to_int is False:
        problems.append(
            "--no-yarn-correction-range-round-to-int is not supported (the correction range is "
            "rounded, as Hugging Face's default)"
        )
    mscale = (getattr(args, "mscale", 1.0), getattr(args, "mscale_all_dim", 0.0))
    if yarn and mscale != (1.0, 0.0) and 0 in mscale:
        problems.append(
            f"--mscale {mscale[0]} with --mscale-all-dim {mscale[1]}: give both "
            "non-zero, or neither (Hugging Face reads a zero as unset)"
        )
    if problems:
        return {}, problems
    if args.use_rope_scaling:
        return {
            "model.rope_type": "llama3",
            "model.rope_scaling_factor": args.rope_scaling_factor,
            "model.rope_original_max_position_embeddings": 8192,
            "model.rope_low_freq_factor": 1.0,
            "model.rope_high_freq_factor": 4.0,
        }, []
    if linear is not None:
        return {"model.rope_type": "linear", "model.rope_scaling_factor": float(linear)}, []
    if yarn:
        return {
            "model.rope_type": "yarn",
            "model.rope_scaling_factor": getattr(args, "rotary_scaling_factor", 1.0),
            "model.rope_original_max_position_embeddings": (
                getattr(args, "yarn_original_max_position_embeddings", None) or 4096
            ),
            "model.yarn_beta_fast": getattr(args, "yarn_beta_fast", None) or 32.0,
            "model.yarn_beta_slow": getattr(args, "yarn_beta_slow", None) or 1.0,
            **(
                {"model.yarn_mscale": mscale[0], "model.yarn_mscale_all_dim": mscale[1]}
                if mscale != (1.0, 0.0)
                else {}
            ),
        }, []
    return {"model.rope_type": "default"}, []


def _moe_tree(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """``model.num_experts`` / ``model.moe_*`` keys from Megatron-LM's MoE flags (none without
    ``--num-experts``: a dense model keeps every MoE field unset), and the problems. Megatron-LM
    combines several load-balancing types with one coefficient each; one is supported here."""
    if not args.num_experts:
        given = [f for f in _given_flags(args) if f.startswith("--moe-")]
        if given:
            return {}, [f"{', '.join(given)} given without --num-experts (a dense model)"]
        return {}, []
    balancing, coeff = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    balancing = [balancing] if isinstance(balancing, str) else list(balancing)
    coeff = [coeff] if isinstance(coeff, float | int) else list(coeff)
    if len(balancing) != 1 or len(coeff) != 1:
        return {}, [
            f"--moe-router-load-balancing-type {' '.join(balancing)} with --moe-aux-loss-coeff "
            f"{' '.join(map(str, coeff))}: one load-balancing type and one coefficient are "
            "supported here"
        ]
    return {
        "model.num_experts": args.num_experts,
        "model.moe_router_topk": args.moe_router_topk,
        "model.moe_ffn_hidden_size": args.moe_ffn_hidden_size,
        "model.moe_shared_expert_intermediate_size": args.moe_shared_expert_intermediate_size,
        "model.moe_router_score_function": args.moe_router_score_function,
        "model.moe_router_load_balancing_type": balancing[0],
        "model.moe_aux_loss_coeff": float(coeff[0]),
        "model.moe_z_loss_coeff": args.moe_z_loss_coeff,
        "model.moe_expert_capacity_factor": args.moe_expert_capacity_factor,
        "model.moe_token_drop_policy": args.moe_token_drop_policy,
        "model.moe_router_enable_expert_bias": args.moe_router_enable_expert_bias,
        "model.moe_router_bias_update_rate": args.moe_router_bias_update_rate,
        "model.moe_grouped_gemm": args.moe_grouped_gemm,
        "model.moe_token_dispatcher_type": args.moe_token_dispatcher_type,
    }, []


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _earl_tree(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted keys from the ``--earl-*`` convenience flags that were given."""
    flags = {
        "layouts.rollout": args.earl_rollout_layout,
        "layouts.experience": args.earl_experience_layout,
        "env.name": args.earl_env,
        "rollout.engine": args.earl_engine,
        "rollout.engine_urls": args.earl_engine_urls,
        "rollout.max_turns": args.earl_max_turns,
        "batch.prompts_per_step": args.earl_prompts_per_step,
        "batch.samples_per_prompt": args.earl_samples_per_prompt,
        "output_dir": args.earl_output_dir,
        "name": args.earl_run_name,
    }
    return {k: v for k, v in flags.items() if v is not None}


def _same(key: str, a: Any, b: Any) -> bool:
    """Equal config values; layouts compare as layouts ("tp2dp1" == "tp2cp1pp1dp1")."""
    if key.startswith("layouts.") and isinstance(a, str) and isinstance(b, str):
        try:
            return layout_sizes(a) == layout_sizes(b)
        except ConfigError:
            return False
    return a == b


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("kwargs", "advantage_kwargs"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
