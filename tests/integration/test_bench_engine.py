"""`megatron-earl bench engine` end to end at a tiny size (batch 2, 4 new tokens, 1 repeat, with
``--floor``): the result has one row per (batch, sampling mode, engine) with finite rates and a
floor time and ceiling per round, the report prints them,
and the HF conversion computes the same logits as the Megatron model. The logits check is shown to
have teeth (a wrong conversion fails it). The ours/HF ratios are paired round by round (shown on
made-up times, with the rounds that have no decode time left out; the ceiling is HF's prefill
time over the floor, round by round). Timings are the benchmark's
business, not this test's.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from megatron_earl.bench.engine import (
    ENGINES,
    SAMPLING_MODES,
    EngineBenchConfig,
    demo_model,
    format_report,
    measure,
)
from megatron_earl.bench.engine_hf import LOGITS_TOL
from megatron_earl.testing.distributed import run_distributed

LOGPROB_TOL = 1e-4


def test_demo_model_is_the_demo_config():
    m = demo_model()
    shape = (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads)
    assert shape == (4, 128, 256, 4)
    assert (m.query_groups, m.vocab_size, m.tie_embeddings, m.params_dtype) == (
        2,
        320,
        False,
        "float32",
    )
    assert demo_model(overrides=["model.num_layers=2"]).num_layers == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"new_tokens": 1},
        {"batches": ()},
        {"batches": (0, 2)},
        {"repeats": 0},
        {"tp": 0},
        {"decode_threads": -1},
        {"tp": 2, "compile_prefill": True},
    ],
)
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="must be"):
        EngineBenchConfig(model=demo_model(), **bad)


def test_bench_engine_end_to_end():
    cfg = EngineBenchConfig(
        model=demo_model(),
        batches=(2,),
        prompt_len=8,
        new_tokens=4,
        repeats=1,
        agree_tokens=4,
        floor=True,
    )
    result = measure(cfg)
    keys = sorted((r.batch, r.sampling, r.engine) for r in result.rows)
    assert keys == sorted((2, s, e) for s in SAMPLING_MODES for e in ENGINES)
    for row in result.rows:
        for value in (row.prefill_s, row.full_s, row.prefill_tok_s, row.decode_tok_s):
            assert math.isfinite(value) and value > 0, row
    a = result.agreement
    assert a.logits_max_diff <= LOGITS_TOL and a.logits_max_abs > 0
    assert a.first_logprob_max_diff <= LOGPROB_TOL
    assert a.greedy_tokens_compared == 2 * 4 and 0 <= a.greedy_tokens_agree <= 8
    assert result.settings["ours_processes"] == 1 and result.settings["hf_processes"] == 1
    assert result.settings["ours_decode_threads"] == 1  # the default: one decode thread
    assert result.settings["ours_step_thread"] is False  # no second OpenMP team next to HF's
    report = format_report(result)
    assert "steps on the event loop thread" in report
    assert "greedy tokens agreeing" in report
    assert sum(line.lstrip().startswith("2 ") for line in report.splitlines()) == 2
    assert json.loads(json.dumps(dataclasses.asdict(result)))["rows"][0]["batch"] == 2
    assert sorted((r.batch, r.sampling) for r in result.ratios) == [(2, s) for s in SAMPLING_MODES]
    for paired in result.ratios:  # structure only: timings are the benchmark's business
        assert len(paired.prefill) == len(paired.decode) == cfg.repeats
        assert len(paired.floor_s) == len(paired.ceiling) == cfg.repeats
        assert all(math.isfinite(v) and v > 0 for v in paired.floor_s + paired.ceiling)
    assert sum(line.startswith("floor    2 ") for line in report.splitlines()) == 2
    assert "our prefill's projections alone" in report
    assert "ours/HF: median of the per-repeat ratios (range)" in report


def test_ratios_are_paired_round_by_round():
    """Each round's ratio is HF's time over ours in that round (decode: full minus prefill run),
    so a machine slowing in one engine's rounds moves both sides of a ratio; a ratio of the two
    medians would not. A round where an engine's full run is not longer than its prefill run
    has no decode ratio, is left out of the median and is printed as left out."""
    from megatron_earl.bench.engine import _ratio
    from megatron_earl.bench.engine_driver import _paired

    times = {  # HF's rounds 0-1 and ours' rounds 2-4 on a machine twice as slow
        ENGINES[0]: [[0.02, 0.02, 0.04, 0.04, 0.04], [0.12, 0.12, 0.24, 0.24, 0.24]],
        ENGINES[1]: [[0.06, 0.06, 0.03, 0.03, 0.03], [0.66, 0.66, 0.33, 0.33, 0.33]],
    }
    paired = _paired(64, "greedy", times)
    assert paired.prefill == pytest.approx((3.0, 3.0, 0.75, 0.75, 0.75))
    assert paired.decode == pytest.approx((6.0, 6.0, 1.5, 1.5, 1.5))
    ours, hf = [[0.01, 0.02, 0.04], [1, 1, 1]], [[0.05, 0.03, 0.06], [1, 1, 1]]
    drift = {ENGINES[0]: ours, ENGINES[1]: hf}
    # paired: (5, 1.5, 1.5) -> 1.5; the ratio of the medians would be 0.05 / 0.02 = 2.5
    assert _paired(64, "greedy", drift).prefill_median == pytest.approx(1.5)
    outlier = {ENGINES[0]: [[0.1, 0.02], [0.1, 0.12]], ENGINES[1]: [[0.03, 0.3], [0.33, 0.3]]}
    paired = _paired(64, "sampled", outlier)
    assert paired.decode == (None, None)  # ours' round 0 and HF's round 1 have no decode time
    assert paired.decode_median is None and _ratio(paired.decode) == "n/a (2 out)"
    assert _ratio((2.0, None, 1.0)) == "1.50 (1.00 to 2.00, 1 out)"
    floored = _paired(64, "greedy", times, [0.01, 0.01, 0.02, 0.015, 0.015])
    assert floored.ceiling == pytest.approx((6.0, 6.0, 1.5, 2.0, 2.0))
    assert floored.floor_s == (0.01, 0.01, 0.02, 0.015, 0.015)
    assert _paired(64, "greedy", times).ceiling == ()  # no --floor: no ceiling


def _wrong_conversion_diff() -> tuple[float, float]:
    """Logits diff when layer 0's fused QKV rows are read as a plain [Q; K; V] concatenation."""
    from megatron_earl import runtime
    from megatron_earl.bench import engine_hf as bench_hf
    from megatron_earl.models.gpt import build_model
    from megatron_earl.models.impl import pin_transformer_impl
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.redistribute.geometry import full_state_dict

    initialize_layout(ParallelLayout())
    runtime.seed(0)
    model = pin_transformer_impl(demo_model(), embedded_engine=True)
    chunks = build_model(model)
    full = full_state_dict(chunks)
    prompt = torch.arange(8)
    right = bench_hf.logits_max_diff(chunks[0], bench_hf.hf_model(full, model), prompt, 320)[0]
    key = "decoder.layers.self_attention.linear_qkv.weight"
    wrong = dict(full)
    wrong[key] = full[key].clone()
    wrong[key][0] = full[key][0].roll(model.head_dim, dims=0)
    bad = bench_hf.logits_max_diff(chunks[0], bench_hf.hf_model(wrong, model), prompt, 320)[0]
    return right, bad


def test_logits_check_detects_a_wrong_conversion():
    right, bad = run_distributed(_wrong_conversion_diff, 1, timeout_s=300)[0]
    assert right <= LOGITS_TOL < bad


@pytest.mark.parametrize("flags", [["--decode-threads", "-1"], ["--repeats", "0"]])
def test_a_bad_flag_ends_with_its_message(flags):
    from megatron_earl.bench.engine import main

    with pytest.raises(SystemExit, match=r"^bench engine: .*(decode_threads|repeats)"):
        main(flags)
