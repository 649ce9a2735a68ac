"""`megatron-earl bench soak`, a few seconds of it: a real serve process under normal and hostile
clients at once; every normal request holds, every probe gets its status, /health answers, the
engine drains (the long soak is run by hand: docs/reliability.md)."""

from __future__ import annotations

import json

import pytest

from megatron_earl.bench.engine import demo_model
from megatron_earl.bench.soak import PROBES, SoakSetting, format_report, run_soak
from megatron_earl.testing.distributed import free_port


def test_setting_validation_names_the_values():
    with pytest.raises(ValueError, match="'concurrency': 0"):
        SoakSetting(concurrency=0)
    with pytest.raises(ValueError, match=r"prompt_len \(100\) \+ new_tokens \(16\)"):
        SoakSetting(prompt_len=100, max_seq_len=64)


def test_a_short_soak_holds(tmp_path):
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(demo_model().to_dict()))
    # body_timeout 0.5 s: one hostile client passes every probe, the slow sender included.
    setting = SoakSetting(
        duration_s=4, concurrency=2, hostile_clients=2, body_timeout_s=0.5, max_batch_size=4
    )
    result = run_soak(setting, model_json, free_port())
    report = format_report(setting, result)
    assert result.held, report
    assert result.latencies_s and not result.normal_failed
    assert all(sum(result.probes[p.name].values()) >= 1 for p in PROBES), report
    assert result.health_checks >= 5 and result.health_failed == 0
    assert len(result.rss_mib) >= 3 and result.drained_s is not None
    assert result.server_errors == [], report
    assert report.endswith("HELD")
