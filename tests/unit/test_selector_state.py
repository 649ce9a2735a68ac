"""Saving and restoring the selector's state: JSON round trip, identical next decisions after a
restore (hysteresis and OOM marks included), and bad states that raise and restore nothing.
World 2, a tiny model, an experience selector (every layout) and a rollout selector (tp/dp only)
sharing one throughput table and one calibrated memory model, as ``build_selectors`` builds them."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.calibrate import CalibrationPoint, fit
from megatron_earl.selector.decide import Selector, SelectorConfig
from megatron_earl.selector.memory import MemoryModel, MemorySettings
from megatron_earl.selector.oom import run_phase_with_recovery
from megatron_earl.selector.state import load_selector_state, selector_state
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
# tokens/s per layout, recorded twice per cell (EMA 0.3); from 1024 tokens on cp2 is 4 % faster
# than pp2 (within the 10 % hysteresis)
SPEEDS = {DP2: (10000, 12000), PP2: (8000, 8200), CP2: (7600, 7800), TP2: (6000, 5000)}
CP2_LONG = (8300, 8500)
# experience batches run before the save; dp2 runs out of memory from 1024 tokens on
BATCHES = [[512, 384], [1024, 768], [1024, 900], [1100, 700], [1200, 1000]]
# batches decided after the save, by the original and by the restored selectors
NEXT = [[1200, 1100], [1300, 600], [2048, 1500], [700, 500]]


def build() -> dict[str, Selector]:
    memory = MemoryModel(TINY, SETTINGS)
    table = ThroughputTable(Roofline(TINY, HardwareSpec.cpu()), ema=0.3)
    cfg = SelectorConfig(budget_bytes=24 * MiB, token_budget=256)
    return {
        "experience": Selector(TINY, 2, cfg, memory, table),
        "rollout": Selector(TINY, 2, cfg, memory, table, candidates=[DP2, TP2]),
    }


def calibration_points(memory: MemoryModel) -> list[CalibrationPoint]:
    """Synthetic measurements 10-20 % above the model's prediction, at two sizes per layout."""
    points = []
    for layout, excess in ((DP2, 1.1), (TP2, 1.2)):
        for lengths in ((512, 384), (1024, 768)):
            work = CalibrationPoint("experience", str(layout), lengths, 256, 0, 0).workload()
            peak = memory.peak("experience", layout, work)
            measured = int(peak.total * excess)
            points.append(
                CalibrationPoint(
                    "experience", str(layout), lengths, 256, measured, int(peak.static)
                )
            )
    return points


def drive(selectors: dict[str, Selector]) -> list[CalibrationPoint]:
    """Calibrate, fill the table, run experience steps (with one OOM) and rollout decisions."""
    exp, rollout = selectors["experience"], selectors["rollout"]
    points = calibration_points(exp.memory)
    exp.memory.settings = fit(exp.memory, points, per_layout=True)
    for length in (512, 1024, 2048):
        for layout, speeds in SPEEDS.items():
            for speed in CP2_LONG if layout == CP2 and length > 1024 else speeds:
                exp.table.record("experience", layout, length, tokens=speed, seconds=1.0)
    exp.table.record("rollout", TP2, 512, tokens=3000, seconds=1.0)

    def phase_fn(lengths: list[int], layout: ParallelLayout) -> None:
        if layout == DP2 and max(lengths) >= 1024:
            raise torch.OutOfMemoryError(f"{layout} at {max(lengths)} tokens")

    for step, lengths in enumerate(BATCHES):
        run_phase_with_recovery(
            phase_fn,
            lengths,
            selector=exp,
            phase="experience",
            lengths=lengths,
            switch=lambda layout: None,
            step=step,
        )
        rollout.decide("rollout", [n // 2 for n in lengths], step=step)
    exp.mark_infeasible("experience", PP2, 4096)  # as an OOM at 4096 tokens would
    return points


def test_state_is_json_and_restores_equal():
    selectors = build()
    points = drive(selectors)
    state = selector_state(selectors, points)
    assert json.loads(json.dumps(state)) == state
    assert set(state) == {"version", "selectors", "table", "memory", "points"}
    assert state["version"] == 1 and "log" not in state["selectors"]["experience"]
    exp = state["selectors"]["experience"]
    assert exp["current"] == {"experience": "tp1cp1pp2dp1"}
    assert exp["infeasible"] == [
        ["experience", "tp1cp1pp1dp2", 1024],
        ["experience", "tp1cp1pp2dp1", 4096],
    ]
    assert exp["history"]["experience"] == [1024, 1024, 1100, 1200]  # last trend_window
    assert state["selectors"]["rollout"]["current"] == {"rollout": "tp1cp1pp1dp2"}
    assert len(state["table"]["cells"]) == 13 and state["table"]["counts"][0][3] == 2
    assert state["memory"]["activation_scale"]["experience"] != 1.0  # the calibrated constants
    assert state["memory"]["layout_fit"]  # per-layout fit: tuples saved as lists
    assert state["points"][0]["lengths"] == [512, 384]

    fresh = build()
    table, memory = fresh["experience"].table, fresh["experience"].memory
    restored = load_selector_state(fresh, json.loads(json.dumps(state)))
    assert restored == points
    assert fresh["experience"].memory.settings == selectors["experience"].memory.settings
    assert fresh["rollout"].table is table and fresh["rollout"].memory is memory
    assert selector_state(fresh, restored) == state
    assert fresh["experience"].log == []


def test_restored_selectors_decide_like_the_originals():
    original = build()
    state = json.dumps(selector_state(original, drive(original)))
    restored, unrestored = build(), build()
    load_selector_state(restored, json.loads(state))
    reasons = []
    for step, lengths in enumerate(NEXT, start=len(BATCHES)):
        for phase in ("experience", "rollout"):
            want = original[phase].decide(phase, lengths, step=step)
            assert restored[phase].decide(phase, lengths, step=step) == want
            reasons.append(want.reason)
    # the decisions exercise what was restored: hysteresis from the current layout, the OOM
    # marks, the measured table; a selector starting afresh decides differently
    assert {"keep (hysteresis)", "current infeasible"} <= set(reasons), reasons
    first = original["experience"].log[len(BATCHES)]
    assert any(c.source == "infeasible" for c in first.candidates)
    assert unrestored["experience"].decide("experience", NEXT[0]) != first
    assert restored["experience"].log == original["experience"].log[len(BATCHES) :]


def _bad(state: dict, change: str) -> None:
    if change == "version":
        state["version"] = 2
    elif change == "unselected phase":
        state["selectors"]["train"] = state["selectors"]["rollout"]
    elif change == "unknown phase":
        state["selectors"]["rollout"]["history"]["decode"] = [3]
    elif change == "rollout layout":
        state["selectors"]["rollout"]["current"]["rollout"] = "tp1cp2pp1dp1"
    elif change == "table layout":
        state["table"]["cells"].append(["experience", "tp2cp1pp1dp2", 512, 1.0])
    elif change == "memory field":
        state["memory"]["activation_scales"] = {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("version", "version 2 is not supported; expected 1"),
        ("unselected phase", "phase 'train', which this run does not select"),
        ("unknown phase", "unknown phase 'decode'"),
        ("rollout layout", r"'tp1cp2pp1dp1' is not among .*\['tp1cp1pp1dp2', 'tp2cp1pp1dp1'\]"),
        ("table layout", "'tp2cp1pp1dp2' is not among the candidates"),
        ("memory field", r"unknown fields \['activation_scales'\]"),
    ],
)
def test_bad_state_raises_and_restores_nothing(change: str, message: str):
    original = build()
    state = selector_state(original, drive(original))
    _bad(state, change)
    fresh = build()
    fresh["experience"].decide("experience", [300, 200])
    before, settings = selector_state(fresh), fresh["experience"].memory.settings
    with pytest.raises(ValueError, match=message):
        load_selector_state(fresh, state)
    assert selector_state(fresh) == before
    assert fresh["experience"].memory.settings is settings


def test_selectors_must_share_one_table():
    selectors = build()
    selectors["rollout"].table = ThroughputTable(Roofline(TINY, HardwareSpec.cpu()))
    with pytest.raises(ValueError, match="2 throughput tables"):
        selector_state(selectors)
