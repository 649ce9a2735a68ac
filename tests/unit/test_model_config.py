"""ModelConfig validation and vocabulary padding: clear errors naming the values."""

from __future__ import annotations

import pytest

from megatron_earl.config.model import ModelConfig, ModelConfigError


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (
            {"num_attention_heads": 6, "num_query_groups": 4},
            "num_attention_heads (6) must be divisible by num_query_groups (4)",
        ),
        (
            {"hidden_size": 50, "num_attention_heads": 4},
            "hidden_size (50) must be divisible by num_attention_heads (4)",
        ),
        ({"num_layers": 0}, "'num_layers': 0"),
        ({"params_dtype": "fp8"}, "params_dtype 'fp8' is not one of"),
        ({"attention_backend": "flash"}, "attention_backend 'flash'"),
        ({"recompute_granularity": "some"}, "recompute_granularity 'some'"),
        ({"hidden_dropout": 1.5}, "hidden_dropout (1.5) must be in [0, 1)"),
        (
            {"rope_type": "dynamic"},
            "rope_type 'dynamic' is not supported; supported: 'default', 'linear', 'llama3', "
            "'yarn'",
        ),
        (  # a factor without a scaling type names both
            {"rope_scaling_factor": 8.0},
            "rope_scaling_factor=8.0 conflicts with rope_type='default'",
        ),
        (
            {"rope_type": "llama3", "yarn_beta_fast": 16.0},
            "yarn_beta_fast=16.0 conflicts with rope_type='llama3'",
        ),
        ({"rope_type": "llama3"}, "rope_type='llama3' requires ['rope_scaling_factor']"),
        (
            {"rope_type": "yarn", "rope_scaling_factor": 4.0},
            "rope_type='yarn' requires ['rope_original_max_position_embeddings']",
        ),
        ({"rope_type": "linear", "rope_scaling_factor": 0.5}, "rope_scaling_factor (0.5)"),
        (
            {"rope_type": "llama3", "rope_scaling_factor": 8.0, "rope_low_freq_factor": 4.0},
            "rope_low_freq_factor (4.0) must be > 0 and < rope_high_freq_factor (4.0)",
        ),
        (
            {
                "rope_type": "yarn",
                "rope_scaling_factor": 4.0,
                "rope_original_max_position_embeddings": 32,
                "yarn_mscale": 0.7,
            },
            "yarn_mscale (0.7) and yarn_mscale_all_dim (None) are set together",
        ),
    ],
)
def test_invalid_model_config_names_the_values(kwargs, fragment):
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(**kwargs)
    assert fragment in str(err.value)


def test_kv_channels_allows_hidden_not_divisible_by_heads():
    cfg = ModelConfig(hidden_size=50, num_attention_heads=4, kv_channels=16)
    assert cfg.head_dim == 16


def test_vocab_padding_is_layout_independent():
    cfg = ModelConfig(
        vocab_size=1000, make_vocab_size_divisible_by=128, num_attention_heads=8, hidden_size=64
    )
    assert cfg.padded_vocab_size == 1024
    cfg.validate_for_parallel(tp=8)
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(vocab_size=1001, make_vocab_size_divisible_by=1).validate_for_parallel(tp=2)
    assert "padded vocab (1001" in str(err.value) and "% tp (2)" in str(err.value)


@pytest.mark.parametrize(
    "vocab,divisor,tp,padded",
    [
        (128256, 128, 1, 128256),  # Llama-3: a multiple of 128 already
        (128256, 128, 8, 129024),  # Megatron-LM at TP8: a multiple of 1024
        (152064, 128, 4, 152064),  # Qwen2.5-7B at TP4: a multiple of 512 already
        (100, 8, 2, 112),
        (100, 8, 4, 128),
    ],
)
def test_megatron_lm_vocab_padding_multiplies_by_its_tp(vocab, divisor, tp, padded):
    cfg = ModelConfig(
        vocab_size=vocab,
        make_vocab_size_divisible_by=divisor,
        vocab_padding="megatron-lm",
        vocab_padding_tp=tp,
    )
    assert cfg.padded_vocab_size == padded
    assert cfg.to_dict()["vocab_padding"] == "megatron-lm"
    earl = ModelConfig(vocab_size=vocab, make_vocab_size_divisible_by=divisor)
    assert earl.padded_vocab_size == -(-vocab // divisor) * divisor


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"vocab_padding": "megatron-lm"}, "set vocab_padding_tp to that TP (>= 1), got None"),
        ({"vocab_padding": "megatron-lm", "vocab_padding_tp": 0}, "got 0"),
        ({"vocab_padding_tp": 8}, "vocab_padding_tp (8) is read by vocab_padding 'megatron-lm'"),
        ({"vocab_padding": "mlm"}, "unknown VocabPadding 'mlm'; valid: earl, megatron-lm"),
    ],
)
def test_vocab_padding_settings_are_validated(kwargs, fragment):
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(**kwargs)
    assert fragment in str(err.value)


def test_parallel_validation_reports_every_problem():
    cfg = ModelConfig(num_layers=3, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96)
    with pytest.raises(ModelConfigError) as err:
        cfg.validate_for_parallel(tp=4, pp=2)
    msg = str(err.value)
    assert "num_query_groups (2) % tp (4)" in msg
    assert "num_layers (3) % (pp (2) x vpp (1))" in msg


def test_parameter_count_matches_formula_for_tied_and_untied():
    untied = ModelConfig(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=16,
        num_attention_heads=2,
        vocab_size=10,
        make_vocab_size_divisible_by=8,
    )
    # qkv 8*24 + proj 8*8 + fc1 2*8*16 + fc2 16*8 + 2 norms 16 = 192+64+256+128+16 = 656
    # embeddings 16*8 twice = 256, final norm 8
    assert untied.num_parameters() == 656 + 256 + 8
    tied = ModelConfig(**{**untied.to_dict(), "tie_embeddings": True})
    assert tied.num_parameters() == 656 + 128 + 8


def test_rope_type_defaults_are_filled():
    """llama3 without its frequency fields is Llama 3.1's (Megatron-LM's --use-rope-scaling)."""
    cfg = ModelConfig(rope_type="llama3", rope_scaling_factor=8.0)
    assert (
        cfg.rope_original_max_position_embeddings,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
    ) == (8192, 1.0, 4.0)
    assert ModelConfig(**cfg.to_dict()) == cfg
    yarn = ModelConfig(
        rope_type="yarn", rope_scaling_factor=4.0, rope_original_max_position_embeddings=32
    )
    assert (yarn.yarn_beta_fast, yarn.yarn_beta_slow, yarn.yarn_mscale) == (32.0, 1.0, None)
