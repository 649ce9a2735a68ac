"""Mixture-of-experts settings: ``ModelConfig`` validates them naming the value (and refuses them on
a dense model), ``build_transformer_config`` hands them to megatron-core (a dense config is
unchanged), the parameter count includes the experts, the Megatron-LM MoE flags map onto them and
onto the layout string, and the RL loop's start-up check accepts an MoE run on the embedded engine
with fixed layouts and refuses, by name, what such a run cannot do yet."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from megatron_earl.config import ConfigError, load_config
from megatron_earl.config.megatron_args import build_parser, config_from_megatron_args
from megatron_earl.config.model import ModelConfig, ModelConfigError, build_transformer_config
from megatron_earl.orchestration.validate import run_problems

MOE = {"num_experts": 4, "moe_ffn_hidden_size": 32}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_experts": -1}, "num_experts (-1) must be None, 0 (a dense model) or >= 1"),
        ({**MOE, "moe_router_topk": 5}, "moe_router_topk (5) must be in [1, num_experts (4)]"),
        ({**MOE, "moe_router_topk": 0}, "moe_router_topk (0) must be in [1, num_experts (4)]"),
        ({**MOE, "moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size (0) must be None or >= 1"),
        (
            {**MOE, "moe_shared_expert_intermediate_size": -8},
            "moe_shared_expert_intermediate_size (-8) must be None or >= 1",
        ),
        ({**MOE, "moe_router_score_function": "relu"}, "moe_router_score_function 'relu' is"),
        ({**MOE, "moe_router_load_balancing_type": "x"}, "moe_router_load_balancing_type 'x' is"),
        ({**MOE, "moe_token_drop_policy": "random"}, "moe_token_drop_policy 'random' is not"),
        ({**MOE, "moe_token_dispatcher_type": "flex"}, "moe_token_dispatcher_type 'flex' is not"),
        ({**MOE, "moe_aux_loss_coeff": -0.1}, "moe_aux_loss_coeff (-0.1) must be >= 0"),
        ({**MOE, "moe_z_loss_coeff": -1.0}, "moe_z_loss_coeff (-1.0) must be None or >= 0"),
        ({**MOE, "moe_expert_capacity_factor": 0.0}, "moe_expert_capacity_factor (0.0) must be"),
        ({**MOE, "moe_router_bias_update_rate": 0.0}, "moe_router_bias_update_rate (0.0) must"),
        (
            {
                **MOE,
                "moe_expert_capacity_factor": 1.5,
                "moe_router_load_balancing_type": "sinkhorn",
            },
            "moe_expert_capacity_factor (1.5) does not work with moe_router_load_balancing_type",
        ),
        (
            {**MOE, "moe_router_enable_expert_bias": True},
            "moe_router_enable_expert_bias needs moe_router_score_function 'sigmoid'",
        ),
        ({**MOE, "moe_router_topk": 1}, "moe_router_topk 1 with softmax scores"),
        ({"moe_router_topk": 4}, "moe_router_topk=4 set on a dense model (num_experts=None)"),
        ({"num_experts": 0, "moe_aux_loss_coeff": 0.01}, "moe_aux_loss_coeff=0.01 set on a dense"),
    ],
)
def test_invalid_moe_settings_name_the_value(kwargs, fragment):
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(**kwargs)
    assert fragment in str(err.value)


def test_every_problem_in_one_message():
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(**MOE, moe_router_topk=9, moe_aux_loss_coeff=-1.0)
    assert "moe_router_topk (9)" in str(err.value) and "moe_aux_loss_coeff (-1.0)" in str(err.value)


def test_transformer_config_carries_the_moe_settings():
    model = ModelConfig(
        **MOE,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=64,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        moe_expert_capacity_factor=1.25,
        moe_token_drop_policy="position",
    )
    config = build_transformer_config(model, ep=2, use_cpu_initialization=True)
    expected = {
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 32,
        "moe_shared_expert_intermediate_size": 64,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 0.01,
        "moe_z_loss_coeff": 0.001,
        "moe_expert_capacity_factor": 1.25,
        "moe_token_drop_policy": "position",
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,  # only build_model asks for TE's grouped GEMM
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
    }
    assert {k: getattr(config, k) for k in expected} == expected
    # moe_ffn_hidden_size unset: each expert is ffn_hidden_size wide
    config = build_transformer_config(ModelConfig(num_experts=4), use_cpu_initialization=True)
    assert config.moe_ffn_hidden_size == ModelConfig().ffn_hidden_size


def test_dense_transformer_config_is_unchanged():
    config = build_transformer_config(ModelConfig(), tp=1, use_cpu_initialization=True)
    assert config.num_moe_experts is None and config.moe_ffn_hidden_size is None
    assert config.expert_model_parallel_size == 1
    assert build_transformer_config(ModelConfig(num_experts=0)).num_moe_experts is None


def test_parameter_count_includes_router_experts_and_shared_experts():
    dense = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2)
    moe = dataclasses.replace(
        dense, num_experts=4, moe_ffn_hidden_size=12, moe_shared_expert_intermediate_size=20
    )
    # the dense MLP (3 x 8 x 16) becomes a router (8 x 4), 4 experts (3 x 8 x 12 each) and a
    # shared expert (3 x 8 x 20)
    assert moe.num_parameters() - dense.num_parameters() == 8 * 4 + 4 * 288 + 480 - 384


MEGATRON = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 256 --swiglu "
    "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
    "--seq-length 128"
)
MOE_FLAGS = (
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
    "--moe-shared-expert-intermediate-size 64 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.002 "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.001 "
    "--moe-z-loss-coeff 0.0001 --moe-expert-capacity-factor 1.5 --moe-token-drop-policy position "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --expert-model-parallel-size 2"
)


def _parse(flags: str, world_size: int = 2):
    argv = shlex.split(f"{MEGATRON} {flags}")
    return config_from_megatron_args(build_parser().parse_args(argv), world_size=world_size)


def test_megatron_moe_flags_map_onto_the_model_and_the_layout():
    cfg = _parse(MOE_FLAGS)
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (8, 2, 32)
    assert m.moe_shared_expert_intermediate_size == 64
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert m.moe_router_bias_update_rate == 0.002
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == ("seq_aux_loss", 0.001)
    assert (m.moe_z_loss_coeff, m.moe_expert_capacity_factor) == (0.0001, 1.5)
    assert (m.moe_token_drop_policy, m.moe_grouped_gemm) == ("position", True)
    assert m.moe_token_dispatcher_type == "alltoall"
    assert cfg.layouts.train == "tp1cp1pp1dp2ep2"
    cfg = _parse(f"{MOE_FLAGS} --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", 4)
    assert cfg.layouts.train == "tp2cp1pp1dp2ep2etp1"


def test_megatron_dense_recipe_leaves_moe_unset():
    m = _parse("").model
    assert m.num_experts is None and m.moe_grouped_gemm is True and not m.is_moe


def test_megatron_moe_flag_without_num_experts_is_named():
    with pytest.raises(ConfigError, match="--moe-router-topk given without --num-experts"):
        _parse("--moe-router-topk 4")
    with pytest.raises(ConfigError, match="moe_router_topk=4 set on a dense model"):
        load_config(None, ["model.moe_router_topk=4"])


def test_megatron_several_load_balancing_types_are_refused():
    with pytest.raises(ConfigError, match="one load-balancing type and one coefficient"):
        _parse("--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss "
               "--moe-aux-loss-coeff 0.01 0.001")  # fmt: skip


def test_megatron_flex_dispatcher_is_refused_by_name():
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type"):
        _parse("--num-experts 4 --moe-token-dispatcher-type flex")


MOE_RUN = [
    "model.num_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.sequence_parallel=true",
    "selector.enabled=false",
    "rollout.embedded.compile_decode=false",
    "rollout.embedded.compile_prefill=false",
]
"""A mixture-of-experts run the RL loop accepts (with the default embedded engine)."""


def test_rl_loop_runs_moe_with_fixed_layouts_and_expert_groups_inside_tp():
    ok = load_config(None, [*MOE_RUN, "layouts.rollout=tp2", "layouts.train=tp2ep2etp1"])
    assert [p for p in run_problems(ok, 2) if "expert" in p or "num_experts" in p] == []


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["layouts.train=tp1dp2ep2"], "layouts.train 'tp1cp1pp1dp2ep2': its expert groups (ep 2"),
        (["layouts.rollout=tp1dp2ep2"], "layouts.rollout 'tp1cp1pp1dp2ep2': the embedded engine"),
        (["selector.enabled=true"], "model.num_experts=4 with selector.enabled=true"),
        (["rollout.embedded.compile_decode=true"], "rollout.embedded.compile_decode=true"),
        (["model.moe_expert_capacity_factor=1.0"], "model.moe_expert_capacity_factor=1.0"),
        (
            ["rollout.engine=sglang", "rollout.engine_urls=[http://127.0.0.1:1]"],
            "model.num_experts=4 with rollout.engine='sglang'",
        ),
    ],
)
def test_rl_loop_refuses_what_moe_runs_cannot_do_yet_naming_it(overrides, fragment):
    cfg = load_config(None, [*MOE_RUN, *overrides])
    problems = run_problems(cfg, 2)
    assert any(p.startswith(fragment) or fragment in p for p in problems), problems


def test_expert_parallelism_on_a_dense_model_is_refused():
    dense = load_config(None, ["layouts.train=tp1dp2ep2"])
    problems = run_problems(dense, 2)
    assert any("ep (2) > 1 but the model is dense" in p for p in problems), problems
