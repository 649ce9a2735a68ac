"""Every flag of Megatron-LM's parser (core_v0.16.1, tests/fixtures/megatron_lm_flags_*.json) is
exactly one of mapped, mapped (RoPE scaling), refused or no effect; refused flags fail naming
themselves with both parsers; conflicting flags fail naming both; the docs table is current."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from megatron_earl.config import ConfigError
from megatron_earl.config.megatron_args import (
    add_earl_args,
    build_parser,
    config_from_megatron_args,
)
from megatron_earl.config.megatron_flag_policy import (
    NO_EFFECT_FLAGS,
    REFUSED_FLAGS,
    ROPE_SCALING_FLAGS,
)
from megatron_earl.config.megatron_flags import add_megatron_flags

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((ROOT / "tests/fixtures/megatron_lm_flags_core_v0.16.1.json").read_text())
MEGATRON_LM_FLAGS = FIXTURE["flags"]
# Ours but not Megatron-LM 0.16's: the older spelling of --num-virtual-stages-per-pipeline-rank.
LEGACY_FLAGS = {
    "--virtual-pipeline-model-parallel-size",
    # YaRN flags of other Megatron-LM releases that recipes carry (0.16.1 sets YaRN through
    # --rotary-scaling-factor / --mscale only); mapped with the RoPE scaling of issue 18.
    "--yarn-original-max-position-embeddings",
    "--yarn-beta-fast",
    "--yarn-beta-slow",
    "--yarn-correction-range-round-to-int",
    "--no-yarn-correction-range-round-to-int",
}
"""Flags our parser knows that Megatron-LM core_v0.16.1's does not."""

MINIMAL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 256 --swiglu "
    "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
    "--seq-length 128"
).split()


def _mapped() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_megatron_flags(parser)
    return {s for a in parser._actions for s in a.option_strings}


def _categories(flag: str) -> list[str]:
    mapped = _mapped()
    return [
        name
        for name, members in (
            ("mapped", mapped),
            ("mapped (RoPE scaling)", set(ROPE_SCALING_FLAGS) - mapped),
            ("refused", REFUSED_FLAGS),
            ("no effect", NO_EFFECT_FLAGS),
        )
        if flag in members
    ]


def test_fixture_is_megatron_lm_0_16():
    assert FIXTURE["version"] == "core_v0.16.1" and len(MEGATRON_LM_FLAGS) == 651


@pytest.mark.parametrize("flag", [f["flag"] for f in MEGATRON_LM_FLAGS])
def test_every_megatron_lm_flag_is_in_exactly_one_category(flag):
    assert len(_categories(flag)) == 1, f"{flag}: {_categories(flag) or 'in no category'}"


def test_no_category_lists_a_flag_megatron_lm_does_not_have():
    known = {f["flag"] for f in MEGATRON_LM_FLAGS}
    ours = _mapped() | set(ROPE_SCALING_FLAGS) | set(REFUSED_FLAGS) | set(NO_EFFECT_FLAGS)
    assert sorted(ours - known - LEGACY_FLAGS) == []


def test_mapped_flags_have_megatron_lms_dest_and_default():
    """The namespace our parser makes is the one Megatron-LM's makes, for every mapped flag."""
    parser = argparse.ArgumentParser(add_help=False)
    add_megatron_flags(parser)
    by_flag = {f["flag"]: f for f in MEGATRON_LM_FLAGS}
    wrong = {
        a.option_strings[0]: ((a.dest, a.default), (f["dest"], f["default"]))
        for a in parser._actions
        if (f := by_flag.get(a.option_strings[0]))
        and (a.dest, a.default) != (f["dest"], f["default"])
    }
    assert not wrong


def test_no_effect_flags_take_megatron_lms_number_of_values():
    nargs = {f["flag"]: f["nargs"] for f in MEGATRON_LM_FLAGS}
    expect = {None: 1, "*": "+"}
    wrong = {
        f: (n, nargs[f]) for f, n in NO_EFFECT_FLAGS.items() if expect.get(nargs[f], nargs[f]) != n
    }
    assert not wrong


@pytest.mark.parametrize("flag", sorted(set(REFUSED_FLAGS) | (set(ROPE_SCALING_FLAGS) - _mapped())))
def test_refused_flag_fails_naming_itself(flag):
    record = next(f for f in MEGATRON_LM_FLAGS if f["flag"] == flag)
    argv = [flag] + (["1"] * (record["nargs"] if isinstance(record["nargs"], int) else 1))
    if not record["takes_value"]:
        argv = [flag]
    with pytest.raises(ConfigError, match=f"{flag}: "):
        config_from_megatron_args(build_parser().parse_args(MINIMAL + argv), world_size=1)


def _megatron_lm_like_parser() -> argparse.ArgumentParser:
    """A parser with every Megatron-LM flag (names, dests, value counts and literal defaults
    from the fixture), ours as we declare them, plus ``add_earl_args``."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_flags(parser)
    declared = {s for a in parser._actions for s in a.option_strings}
    for f in MEGATRON_LM_FLAGS:
        if f["flag"] in declared:
            continue
        if not f["takes_value"]:
            parser.add_argument(f["flag"], dest=f["dest"], action="store_true")
        else:
            nargs = f["nargs"]
            default = f["default"] if not str(f["default"]).startswith("<") else None
            parser.add_argument(
                f["flag"],
                dest=f["dest"],
                nargs=nargs,
                default=default,
                type=type(default)
                if isinstance(default, (int, float)) and not isinstance(default, bool)
                else None,
            )
    return add_earl_args(parser)


def test_refused_flag_fails_with_megatron_lms_own_parser_too():
    parser = _megatron_lm_like_parser()
    args = parser.parse_args([*MINIMAL, "--multi-latent-attention", "--muon-momentum", "0.95"])
    with pytest.raises(ConfigError) as err:
        config_from_megatron_args(args, world_size=1)
    assert "--multi-latent-attention: only SwiGLU" in str(err.value)
    assert "--muon-momentum: " in str(err.value)
    # not given: no error, and no-effect flags are only noted
    args = parser.parse_args([*MINIMAL, "--log-interval", "5", "--use-flash-attn"])
    assert config_from_megatron_args(args, world_size=1).model.num_layers == 2
    # Megatron-LM's validate_args derives arguments after parsing (e.g. the mapped
    # expert_tensor_parallel_size = tp, the refused encoder_num_layers = num_layers): not given,
    # no error, and the derived etp = tp leaves the layout string as it was
    args = parser.parse_args(MINIMAL)
    args.expert_tensor_parallel_size, args.encoder_num_layers = 1, 2
    cfg = config_from_megatron_args(args, world_size=1)
    assert cfg.model.num_layers == 2 and cfg.layouts.train == "tp1cp1pp1dp1"
    # given at Megatron-LM's default value: nothing changes, no error
    args = parser.parse_args([*MINIMAL, "--expert-model-parallel-size", "1"])
    assert config_from_megatron_args(args, world_size=1).model.num_layers == 2


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["--bf16", "--fp16"], ["--bf16", "--fp16"]),
        (
            ["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"],
            ["--lr-warmup-iters", "--lr-warmup-fraction"],
        ),
        (["--num-query-groups", "2"], ["--num-query-groups", "--group-query-attention"]),
        (["--lr-wsd-decay-iters", "5"], ["--lr-wsd-decay-iters", "--lr-decay-style"]),
        (["--lr-decay-style", "WSD"], ["--lr-decay-style WSD", "--lr-wsd-decay-iters"]),
        (["--sgd-momentum", "0.5"], ["--sgd-momentum", "--optimizer"]),
        (["--recompute-method", "uniform"], ["--recompute-method", "--recompute-granularity"]),
        (
            ["--recompute-granularity", "full", "--recompute-method", "block"],
            ["--recompute-method block"],
        ),
    ],
)
def test_conflicting_flags_name_both(extra, names):
    with pytest.raises(ConfigError) as err:
        config_from_megatron_args(build_parser().parse_args(MINIMAL + extra), world_size=1)
    for name in names:
        assert name in str(err.value)


def test_unsupported_optimizer_value_is_named():
    with pytest.raises(ConfigError, match=r"--optimizer.*muon"):
        build_parser().parse_args([*MINIMAL, "--optimizer", "muon"])


def test_docs_flag_table_is_generated_from_the_code():
    spec = importlib.util.spec_from_file_location(
        "megatron_flags_table", ROOT / "scripts/megatron_flags_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.DOC.read_text()
    assert module.updated(text) == text, "run: python scripts/megatron_flags_table.py"
