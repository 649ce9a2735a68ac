"""Megatron-LM argument bridge: a real-looking Qwen2.5-7B recipe command line parses unchanged with
our ``earl`` group added, maps onto RunConfig, and bad input gives one clear error."""

from __future__ import annotations

import argparse
import shlex

import pytest

from megatron_earl.config import ConfigError, load_config, save_config
from megatron_earl.config.megatron_args import (
    add_earl_args,
    build_parser,
    config_from_megatron_args,
)
from megatron_earl.config.run import RuntimeConfig
from megatron_earl.config.vocab import Phase
from megatron_earl.orchestration.validate import validate_run
from megatron_earl.parallel.layout import ParallelLayout, phase_layout

# The argument arrays of a typical Megatron-LM Qwen2.5-7B recipe (model, parallelism, optimizer,
# checkpoints, data and logging), as a bash script would expand them.
QWEN25_7B_RECIPE = """
    --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28
    --group-query-attention --num-query-groups 4 --kv-channels 128
    --max-position-embeddings 32768 --seq-length 4096
    --use-rotary-position-embeddings --rotary-base 1000000
    --swiglu --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6
    --untie-embeddings-and-output-weights --vocab-size 152064 --make-vocab-size-divisible-by 128
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --position-embedding-type rope --no-rope-fusion --attention-softmax-in-fp32
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --context-parallel-size 2
    --use-distributed-optimizer --overlap-grad-reduce
    --micro-batch-size 1 --global-batch-size 256 --train-iters 200
    --lr 1e-6 --lr-decay-style constant --min-lr 1e-7 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.98 --adam-eps 1e-8 --clip-grad 1.0
    --bf16 --seed 42 --recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1 --transformer-impl transformer_engine --attention-backend flash
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model Qwen/Qwen2.5-7B-Instruct
    --data-path /data/a_text_document /data/b_text_document --split 99,1,0
    --load {load} --save /ckpt/qwen25_7b_rl --save-interval 20 --ckpt-format torch_dist
    --no-load-optim --no-load-rng --log-interval 1 --tensorboard-dir /runs/tb
    --distributed-backend nccl --distributed-timeout-minutes 60
"""

EARL = """
    --earl-rollout-layout tp2cp1pp1dp16 --earl-env python_sum --earl-max-turns 8
    --earl-prompts-per-step 32 --earl-samples-per-prompt 8 --earl-run-name qwen_rl
    --earl-override train.loss.kl_coef=0.001 rollout.sampling.max_new_tokens=1024
"""


def _parse(text: str, **fmt) -> argparse.Namespace:
    return build_parser().parse_args(shlex.split(text.format(**fmt)))


def test_qwen25_7b_recipe_maps_onto_run_config(tmp_path):
    args = _parse(QWEN25_7B_RECIPE + EARL, load=tmp_path)
    cfg = config_from_megatron_args(args, world_size=32)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (28, 3584, 18944)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (28, 4, 128)
    assert (m.vocab_size, m.make_vocab_size_divisible_by) == (152064, 128)
    # Megatron-LM's padding at the recipe's TP (4): its vocabulary and checkpoints round-trip
    assert (m.vocab_padding, m.vocab_padding_tp, m.padded_vocab_size) == ("megatron-lm", 4, 152064)
    assert m.max_position_embeddings == 32768 and m.rotary_base == 1e6 and m.norm_epsilon == 1e-6
    assert m.add_qkv_bias and not m.qk_layernorm and not m.tie_embeddings
    assert m.params_dtype == "bfloat16" and m.recompute_granularity == "full"
    assert m.attention_dropout == 0.0 and m.hidden_dropout == 0.0
    assert phase_layout(cfg.layouts, Phase.TRAIN) == ParallelLayout(tp=4, cp=2, pp=2, dp=2)
    assert phase_layout(cfg.layouts, Phase.EXPERIENCE) == phase_layout(cfg.layouts, Phase.TRAIN)
    assert phase_layout(cfg.layouts, Phase.ROLLOUT) == ParallelLayout(tp=2, dp=16)
    t = cfg.train
    assert (t.lr, t.min_lr, t.weight_decay, t.adam_beta2, t.clip_grad) == (1e-6, 1e-7, 0.1, 0.98, 1)
    assert t.use_distributed_optimizer and t.loss.kl_coef == 0.001
    assert cfg.seed == 42 and cfg.steps == 200 and cfg.rollout.max_context == 4096
    assert cfg.checkpoint.load == str(tmp_path) and cfg.checkpoint.dir == "/ckpt/qwen25_7b_rl"
    assert cfg.checkpoint.interval == 20 and cfg.logging.tensorboard_dir == "/runs/tb"
    assert cfg.env.name == "python_sum" and cfg.rollout.max_turns == 8
    assert cfg.batch.samples_per_step == 256 and cfg.name == "qwen_rl"
    assert cfg.runtime.collective_timeout_s == 3600.0  # --distributed-timeout-minutes 60
    with pytest.raises(ConfigError, match=r"--distributed-timeout-minutes 0: must be > 0"):
        config_from_megatron_args(
            _parse(QWEN25_7B_RECIPE.replace("minutes 60", "minutes 0") + EARL, load=tmp_path), 32
        )
    assert cfg.rollout.sampling.max_new_tokens == 1024
    validate_run(cfg, world_size=32)
    # the resolved config of a Megatron-args run saves and loads like any other
    assert load_config(save_config(cfg, tmp_path / "config.yaml")) == cfg


@pytest.mark.parametrize(
    ("flag", "impl"),
    [
        ("--transformer-impl local", "local"),
        ("--transformer-impl transformer_engine", "auto"),  # TE where it can run (CUDA + TE)
        ("", "auto"),  # Megatron-LM's default is transformer_engine
    ],
)
def test_transformer_impl_is_honoured(tmp_path, flag, impl):
    recipe = QWEN25_7B_RECIPE.replace("--transformer-impl transformer_engine", flag)
    cfg = config_from_megatron_args(_parse(recipe + EARL, load=tmp_path), world_size=32)
    assert cfg.model.transformer_impl == impl


def test_add_earl_args_is_an_extra_args_provider():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)  # stands for Megatron-LM's own parser
    assert add_earl_args(parser) is parser
    groups = [g.title for g in parser._action_groups]
    assert "earl" in groups
    args = parser.parse_args(["--num-layers", "2", "--earl-override", "steps=3", "seed=1"])
    assert args.num_layers == 2 and args.earl_override == ["steps=3", "seed=1"]


def test_yaml_supplies_what_megatron_args_do_not(tmp_path):
    yaml_path = tmp_path / "rl.yaml"
    yaml_path.write_text(
        "env: {name: guessing}\nlayouts: {rollout: tp1dp2}\nbatch: {samples_per_prompt: 2}\n"
    )
    args = _parse(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 320 --swiglu "
        "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
        "--make-vocab-size-divisible-by 64 --seq-length 256 --tensor-model-parallel-size 2 "
        f"--earl-config {yaml_path} --earl-override steps=3"
    )
    cfg = config_from_megatron_args(args, world_size=2)
    assert cfg.env.name == "guessing" and cfg.steps == 3
    assert phase_layout(cfg.layouts, Phase.ROLLOUT) == ParallelLayout(dp=2)
    assert (
        phase_layout(cfg.layouts, Phase.TRAIN)
        == ParallelLayout(tp=2)
        == phase_layout(cfg.layouts, Phase.EXPERIENCE)
    )
    assert cfg.model.ffn_hidden_size == 128  # Megatron-LM's SwiGLU default: 4h * 2/3, to 64
    assert cfg.model.num_query_groups is None  # no --group-query-attention: MHA
    assert cfg.model.hidden_dropout == 0.1  # Megatron-LM's default
    # omitted --distributed-timeout-minutes: the run's default, not Megatron-LM's 10 minutes
    assert cfg.runtime.collective_timeout_s == RuntimeConfig().collective_timeout_s


def test_yaml_and_megatron_disagreeing_is_an_error(tmp_path):
    yaml_path = tmp_path / "rl.yaml"
    yaml_path.write_text("model: {hidden_size: 128}\n")
    args = _parse(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 320 --swiglu "
        f"--disable-bias-linear --normalization RMSNorm --use-rotary-position-embeddings "
        f"--seq-length 128 --earl-config {yaml_path}"
    )
    with pytest.raises(ConfigError, match=r"model.hidden_size: 128 in .* but 64 from the Megatron"):
        config_from_megatron_args(args, world_size=1)


def test_unsupported_architecture_is_one_error():
    args = _parse("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8")
    with pytest.raises(ConfigError) as err:
        config_from_megatron_args(args, world_size=1)
    text = str(err.value)
    for fragment in ("RMSNorm", "--swiglu", "--disable-bias-linear", "only rope", "--vocab-size"):
        assert fragment in text


def test_parallel_sizes_must_divide_the_world():
    args = _parse(QWEN25_7B_RECIPE, load="/x")
    with pytest.raises(ConfigError, match=r"world size \(12\) is not divisible by tp \(4\)"):
        config_from_megatron_args(args, world_size=12)


def test_unknown_flag_names_the_nearest_one():
    with pytest.raises(ConfigError, match=r"--hiden-size \(did you mean --hidden-size\?\)"):
        _parse("--num-layers 2 --hiden-size 64")
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        _parse("--hidden 64")  # no abbreviations (Megatron-LM: allow_abbrev=False)


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = _parse(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 320 --swiglu "
        "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
        "--seq-length 128 --make-vocab-size-divisible-by 64"
    )
    assert phase_layout(config_from_megatron_args(args).layouts, Phase.TRAIN) == ParallelLayout(
        dp=4
    )


def test_equal_layouts_spelled_differently_do_not_conflict(tmp_path):
    yaml_path = tmp_path / "rl.yaml"
    yaml_path.write_text("layouts: {train: tp2}\nmodel: {hidden_dropout: 0.1}\n")
    args = _parse(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 320 --swiglu "
        "--disable-bias-linear --normalization RMSNorm --use-rotary-position-embeddings "
        f"--seq-length 128 --tensor-model-parallel-size 2 --earl-config {yaml_path}"
    )
    cfg = config_from_megatron_args(args, world_size=2)
    assert cfg.layouts.train == "tp2cp1pp1dp1" and cfg.model.hidden_dropout == 0.1


def test_every_flag_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "megatron_earl/docs/megatron_args.md").read_text()
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")]
    missing = [f for f in flags if f"`{f}" not in doc and f != "--help"]
    assert not missing, f"flags missing from docs/megatron_args.md: {missing}"


def test_recipe_can_opt_out_of_megatron_lm_vocab_padding(tmp_path):
    opt_out = " model.vocab_padding=earl model.vocab_padding_tp=null"
    args = _parse(QWEN25_7B_RECIPE + EARL + opt_out, load=tmp_path)
    m = config_from_megatron_args(args, world_size=32).model
    assert (m.vocab_padding, m.vocab_padding_tp) == ("earl", None)
