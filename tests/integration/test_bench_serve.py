"""`megatron-earl bench serve`: a real serve process under a small concurrent load; every request
comes back complete (no timing is asserted: figures belong to the benchmark's report)."""

from __future__ import annotations

import json

import pytest

from megatron_earl.bench.engine import demo_model
from megatron_earl.bench.serve import ServeLoad, measure, quantile


def test_quantile_and_load_validation():
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    assert quantile([], 0.5) != quantile([], 0.5)  # NaN
    with pytest.raises(ValueError, match="'concurrency': 0"):
        ServeLoad(concurrency=0)


def test_serve_under_concurrent_load_loses_nothing(tmp_path):
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(demo_model().to_dict()))
    load = ServeLoad(concurrency=4, requests=8, warmup=2, new_tokens=6, max_batch_size=4)
    result = measure(".", load, model_json, port=30177)
    assert result.lost == 0
    assert result.requests_per_s > 0 and result.p50_s <= result.p99_s
