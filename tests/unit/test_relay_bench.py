"""``bench relay``'s arithmetic: the measured medians, the fitted direct-stall line and the
MODELLED projections (label, tree levels, the simulator's relay-vs-direct rows)."""

from __future__ import annotations

import argparse

import pytest

from megatron_earl.bench import relay as bench


def _measured(n: int) -> dict:
    direct = 0.1 + 0.5 * n
    return {
        "direct_s": [direct, direct * 1.1, direct * 0.9],
        "relay_stall_s": [0.2, 0.25, 0.3],
        "propagation_s": [1.2, 1.25, 1.3],
        "bytes": 1000,
    }


def test_summary_fits_the_direct_line_and_projects_it(monkeypatch):
    monkeypatch.setattr(bench, "simulated", lambda: [])
    out = bench.summarize({n: _measured(n) for n in (2, 4, 8)}, engines_per_relay=4)
    rows = out["measured"]
    assert rows[8]["direct_stall_s"] == pytest.approx(4.1)
    assert rows[8]["relay_stall_s"] == pytest.approx(0.25)
    assert rows[8]["stall_ratio_direct_over_relay"] == pytest.approx(4.1 / 0.25)
    assert rows[2]["relays"] == 2 and rows[8]["relays"] == 3
    fit = out["projection_MODELLED"]["direct_fit"]
    assert fit["a_s"] == pytest.approx(0.1) and fit["b_s_per_engine"] == pytest.approx(0.5)
    proj = {r["engines"]: r for r in out["projection_MODELLED"]["rows"]}
    assert proj[1024]["direct_stall_s"] == pytest.approx(0.1 + 512)
    assert proj[256]["relay_tree_levels"] == 4  # 256 engines, fan-out 4: 64 relays, 3 more levels
    assert proj[256]["relay_propagation_s"] == pytest.approx(0.25 + 4 * 1.0)
    args = argparse.Namespace(bucket_mb=16, repeats=3, engines_per_relay=4)
    text = bench.report(out, args)
    assert "MEASURED" in text and "PROJECTED (MODELLED" in text and "SIMULATED (MODELLED" in text


def test_simulated_rows_compare_relay_with_direct_on_the_same_workload():
    (row,) = bench.simulated(engines=(16,), steps=2)
    assert row["engines"] == 16 and row["direct_push_s"] == 4.0
    assert row["relay_publish_s"] == bench.SIM_PUBLISH_S
    assert row["relay_push_fraction"] < row["direct_push_fraction"]
    assert row["throughput_ratio_relay_over_direct"] >= 1.0


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        bench.parse_args(["--engines", "2,x"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--engines", "0"])
