"""The standard Megatron-LM flags the minimal parser (``megatron_args.build_parser``) accepts.

``add_megatron_flags`` declares the flags ``config_from_megatron_args`` maps onto ``RunConfig``,
with Megatron-LM's names, destinations and defaults (megatron/training/arguments.py), so the same
namespace comes out of Megatron-LM's own parser and ours. Every other Megatron-LM flag is refused
or has no effect here (``megatron_flag_policy``).
"""

from __future__ import annotations

import argparse


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Declare the mapped Megatron-LM flags (Megatron-LM's names, dests and defaults)."""
    model = parser.add_argument_group("network size (Megatron-LM)")
    add = model.add_argument
    add("--num-layers", type=int, default=None)
    add("--hidden-size", type=int, default=None)
    add("--ffn-hidden-size", type=int, default=None)
    add("--num-attention-heads", type=int, default=None)
    add("--kv-channels", type=int, default=None)
    add("--group-query-attention", action="store_true")
    add("--num-query-groups", type=int, default=1)
    add("--max-position-embeddings", type=int, default=None)
    add("--seq-length", type=int, default=None)
    add(
        "--position-embedding-type",
        default="learned_absolute",
        choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none"),
    )
    add("--use-rotary-position-embeddings", action="store_true")
    add("--rotary-base", type=int, default=10000)
    add("--rotary-percent", type=float, default=1.0)
    add("--rotary-seq-len-interpolation-factor", type=int, default=None)
    add("--use-rope-scaling", action="store_true")
    add("--rope-scaling-factor", type=float, default=8.0)
    add("--rotary-scaling-factor", type=float, default=1.0)
    add("--yarn-original-max-position-embeddings", type=int, default=None)
    add("--yarn-beta-fast", type=float, default=None)
    add("--yarn-beta-slow", type=float, default=None)
    add("--yarn-correction-range-round-to-int", action="store_true", default=None)
    add(
        "--no-yarn-correction-range-round-to-int",
        action="store_false",
        dest="yarn_correction_range_round_to_int",
    )
    add("--mscale", type=float, default=1.0)
    add("--mscale-all-dim", type=float, default=0.0)
    add("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    add("--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon")  # as in 0.16
    add("--swiglu", action="store_true")
    add("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    add("--add-qkv-bias", action="store_true")
    add("--qk-layernorm", action="store_true")
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--vocab-size", type=int, default=None)
    add("--make-vocab-size-divisible-by", type=int, default=128)
    # local: the local spec; transformer_engine (Megatron-LM's default, so also a recipe without
    # the flag): model.transformer_impl "auto", TE where it is importable on CUDA, else local.
    add("--transformer-impl", default="transformer_engine", choices=("local", "transformer_engine"))
    add("--init-method-std", type=float, default=0.02)
    add("--attention-dropout", type=float, default=0.1)
    add("--hidden-dropout", type=float, default=0.1)
    add("--bf16", action="store_true")
    add("--fp16", action="store_true")
    add("--recompute-granularity", default=None, choices=("full", "selective"))
    add("--recompute-num-layers", type=int, default=None)
    add("--recompute-method", default=None, choices=("uniform", "block"))

    moe = parser.add_argument_group("mixture of experts (Megatron-LM)")
    add = moe.add_argument
    add("--num-experts", type=int, default=None)
    add("--moe-router-topk", type=int, default=2)
    add("--moe-ffn-hidden-size", type=int, default=None)
    add("--moe-shared-expert-intermediate-size", type=int, default=None)
    add("--moe-router-score-function", default="softmax", choices=("softmax", "sigmoid"))
    add("--moe-router-load-balancing-type", nargs="+", default="aux_loss")
    add("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    add("--moe-z-loss-coeff", type=float, default=None)
    add("--moe-expert-capacity-factor", type=float, default=None)
    add("--moe-token-drop-policy", default="probs", choices=("probs", "position"))
    add("--moe-router-enable-expert-bias", action="store_true")
    add("--moe-router-bias-update-rate", type=float, default=1e-3)
    # Transformer Engine's grouped GEMM for the experts; the local spec (CPU) ignores it.
    add("--moe-grouped-gemm", action="store_true")
    add("--moe-token-dispatcher-type", default="allgather", choices=("allgather", "alltoall"))

    parallel = parser.add_argument_group("distributed (Megatron-LM)")
    add = parallel.add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--context-parallel-size", type=int, default=1)
    add("--expert-model-parallel-size", type=int, default=1)
    add("--expert-tensor-parallel-size", type=int, default=None)
    add("--sequence-parallel", action="store_true")
    add("--virtual-pipeline-model-parallel-size", type=int, default=None)
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    add("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    add("--distributed-timeout-minutes", type=int, default=10)

    train = parser.add_argument_group("training (Megatron-LM)")
    add = train.add_argument
    add("--lr", type=float, default=None)
    add("--min-lr", type=float, default=0.0)
    add("--weight-decay", type=float, default=0.01)
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999)
    add("--adam-eps", type=float, default=1e-08)
    add("--clip-grad", type=float, default=1.0)
    add("--use-distributed-optimizer", action="store_true")
    add("--optimizer", default="adam", choices=("adam", "sgd"))
    add("--sgd-momentum", type=float, default=0.9)
    add(
        "--lr-decay-style",
        default="linear",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    )
    add("--lr-decay-iters", type=int, default=None)
    add("--lr-warmup-iters", type=int, default=0)
    add("--lr-warmup-fraction", type=float, default=None)
    add("--lr-warmup-init", type=float, default=0.0)
    add(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
    )
    add("--lr-wsd-decay-iters", type=int, default=None)
    add("--seed", type=int, default=1234)
    add("--train-iters", type=int, default=None)

    ckpt = parser.add_argument_group("checkpointing and logging (Megatron-LM)")
    add = ckpt.add_argument
    add("--load", default=None)
    add("--save", default=None)
    add("--save-interval", type=int, default=None)
    add("--tensorboard-dir", default=None)
