"""The decision rule: fastest layout that fits, hysteresis, trend look-ahead, the no-fit error, and
the structured decision record. World 2 (dp2, tp2, cp2, pp2) with a tiny model and a throughput
table filled by hand."""

from __future__ import annotations

import json
import logging

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.decide import (
    NoFeasibleLayout,
    Selector,
    SelectorConfig,
    candidate_layouts,
)
from megatron_earl.selector.memory import MemoryModel, MemorySettings
from megatron_earl.selector.throughput import HardwareSpec, Roofline, ThroughputTable

MiB = 1 << 20
TINY = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=1024,
    make_vocab_size_divisible_by=64,
)
# pinned constants (not the CPU defaults, which a re-calibration may change)
SETTINGS = MemorySettings.cpu(
    activation_scale={"rollout": 1.0, "experience": 1.0, "train": 1.28},
    fixed_bytes={"rollout": 0.0, "experience": 0.0, "train": 0.0},
)
DP2, TP2, CP2, PP2 = (ParallelLayout.parse(s) for s in ("dp2", "tp2", "cp2", "pp2"))


def make_selector(budget_mib: float = 72, speeds: dict | None = None, **config) -> Selector:
    table = ThroughputTable(Roofline(TINY, HardwareSpec.cpu()), ema=1.0)
    speeds = speeds or {DP2: 10000, TP2: 6000, CP2: 5000, PP2: 7000}
    for length in (512, 1024, 2048, 4096, 8192):
        for layout, speed in speeds.items():
            table.record("train", layout, length, tokens=speed, seconds=1.0)
    cfg = SelectorConfig(budget_bytes=budget_mib * MiB, token_budget=256, **config)
    return Selector(TINY, 2, cfg, MemoryModel(TINY, SETTINGS), table)


def test_candidates_are_every_valid_layout():
    assert set(candidate_layouts(2, TINY)) == {DP2, TP2, CP2, PP2}
    wide = ModelConfig(num_attention_heads=4, num_query_groups=2, num_layers=2)
    names = {str(c) for c in candidate_layouts(8, wide)}
    assert "tp2cp1pp1dp4" in names and "tp4cp1pp1dp2" not in names  # 2 query groups % 4
    assert all(c.world_size == 8 for c in candidate_layouts(8, wide))


def test_fastest_fitting_layout_and_switch_when_it_no_longer_fits():
    sel = make_selector()
    first = sel.decide("train", [512, 384], step=0)
    assert first.layout == DP2 and first.reason == "initial"
    long = sel.decide("train", [4096, 3072], step=1)
    # dp2 needs ~86 MiB at 4096 tokens: the fastest layout that fits is tp2
    assert long.layout == TP2 and long.reason == "current does not fit"
    assert long.switched and long.previous == DP2
    fits = {c.layout: c.fits for c in long.candidates}
    assert fits == {
        "tp1cp1pp1dp2": False,
        "tp2cp1pp1dp1": True,
        "tp1cp2pp1dp1": False,
        "tp1cp1pp2dp1": False,
    }
    assert long.peak_bytes * 1.1 <= 72 * MiB


def test_hysteresis_keeps_a_fitting_layout_unless_the_gain_is_large():
    sel = make_selector(speeds={DP2: 10500, TP2: 10000, CP2: 5000, PP2: 7000})
    sel.current["train"] = TP2
    kept = sel.decide("train", [512, 384], step=0)
    assert kept.layout == TP2 and kept.reason == "keep (hysteresis)"  # 5% < switch_gain 10%
    sel = make_selector(speeds={DP2: 13000, TP2: 10000, CP2: 5000, PP2: 7000})
    sel.current["train"] = TP2
    moved = sel.decide("train", [512, 384], step=0)
    assert moved.layout == DP2 and moved.reason == "best"
    # alternating short/long batches with a tiny gain never flap
    sel = make_selector(speeds={DP2: 10500, TP2: 10000, CP2: 5000, PP2: 7000})
    layouts = [sel.decide("train", [n, n], step=i).layout for i, n in enumerate([2048, 512] * 4)]
    assert len(set(layouts)) == 1


def test_trend_moves_before_the_step_that_would_not_fit():
    sel = make_selector()
    for step, n in enumerate([1024, 1536, 2048, 2560]):
        decision = sel.decide("train", [n, n], step=step)
    # growth of 512 tokens/step: 2560 is planned as 3072, which dp2 cannot hold in 72 MiB
    assert decision.stats.slope == pytest.approx(512)
    assert decision.stats.planned == 3072
    plain = make_selector()
    assert plain.decide("train", [2560, 2560]).layout == DP2  # without the trend, dp2 fits
    assert decision.layout == PP2  # the fastest layout that holds 3072 tokens


def test_budget_too_small_names_the_smallest_layout():
    sel = make_selector(budget_mib=8)
    with pytest.raises(NoFeasibleLayout) as info:
        sel.decide("train", [4096, 4096])
    message = str(info.value)
    assert "tp2cp1pp1dp1" in message and "GiB per rank" in message and "4096 tokens" in message
    assert sel.log == []  # nothing decided, nothing run


def test_decision_record_is_logged_as_json(caplog):
    sel = make_selector()
    with caplog.at_level(logging.INFO, logger="megatron_earl.selector"):
        decision = sel.decide("train", [100, 200, 300, 400, 1000], step=3)
    record = json.loads(decision.to_json())
    assert record["layout"] == "tp1cp1pp1dp2" and record["step"] == 3
    assert record["stats"]["p50"] == 300 and record["stats"]["p95"] == 1000
    assert record["stats"]["max"] == 1000 and len(record["candidates"]) == 4
    assert any("selector decision" in r.message for r in caplog.records)
    assert sel.log == [decision]


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match="safety_margin"):
        SelectorConfig(budget_bytes=1, safety_margin=1.5)
    with pytest.raises(ValueError, match="budget_bytes"):
        SelectorConfig(budget_bytes=0)
    with pytest.raises(ValueError, match="phase"):
        make_selector().decide("decode", [10])
