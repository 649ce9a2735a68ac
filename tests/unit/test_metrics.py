"""Observability: metrics JSONL (flat keys, strict JSON, resume truncation), TensorBoard (and its
clean absence), the phase timer, the progress line, and the plots of a synthetic run."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch

from megatron_earl.orchestration.metrics import (
    MetricsLogger,
    PhaseTimer,
    flatten_metrics,
    read_metrics,
    truncate_metrics,
)
from megatron_earl.orchestration.progress import ProgressBar, format_duration, format_progress
from megatron_earl.parallel.layout import ParallelLayout


def test_flatten_nested_tensors_layouts_and_non_finite():
    flat = flatten_metrics(
        {
            "reward": {"mean": torch.tensor(0.5), "std": 0.25},
            "train": {"loss": float("nan"), "grad_norm": float("inf")},
            "layout": {"train": ParallelLayout(tp=2)},
            "context_len_per_turn": {0: 10, 1: 20},
            "tokens_per_s": 1200,
        }
    )
    assert flat == {
        "reward/mean": 0.5,
        "reward/std": 0.25,
        "train/loss": "nan",
        "train/grad_norm": "inf",
        "layout/train": "tp2cp1pp1dp1",
        "context_len_per_turn/0": 10,
        "context_len_per_turn/1": 20,
        "tokens_per_s": 1200,
    }
    with pytest.raises(ValueError, match="metric 'x' is not a scalar: shape \\(2,\\)"):
        flatten_metrics({"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="metric 'y' has a list value"):
        flatten_metrics({"y": [1, 2]})


def test_jsonl_one_strict_line_per_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward/mean": step / 10, "train": {"loss": float("nan")}})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert first == {"step": 1, "reward/mean": 0.1, "train/loss": "nan"}
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert math.isnan(records[2]["train/loss"])


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in range(1, 6):
            log.log(step, {"reward/mean": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # torn line: the crash hit mid-write
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as log:
        log.log(4, {"reward/mean": 40.0})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    assert truncate_metrics(tmp_path / "missing.jsonl", 1) == 0


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "run", enabled=False)
    assert log.log(1, {"a": {"b": 1}}) == {"step": 1, "a/b": 1}
    log.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_scalars_and_layout_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as log:
        assert log.tensorboard_active
        for step in (1, 2):
            log.log(step, {"reward/mean": 0.5 * step, "layout/train": "tp2cp1pp1dp1"})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.5, 1.0]
    assert "layout/train/text_summary" in acc.Tags()["tensors"]


def test_tensorboard_absent_is_skipped_with_a_warning(tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "tensorboard" or name.startswith(("tensorboard.", "torch.utils.tensorboard")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.warns(UserWarning, match="'tensorboard' package is not installed"):
        log = MetricsLogger(tmp_path, tensorboard=True)
    assert not log.tensorboard_active
    log.log(1, {"reward/mean": 1.0})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 1.0}]


def test_phase_timer():
    now = [0.0]
    timer = PhaseTimer(clock=lambda: now[0])
    for phase, seconds in (("rollout", 2.0), ("train", 1.0), ("rollout", 0.5)):
        with timer.phase(phase):
            now[0] += seconds
    now[0] += 0.25  # time outside any phase still counts in time/step
    assert timer.metrics() == {"time/rollout": 2.5, "time/train": 1.0, "time/step": 3.75}
    timer.reset()
    assert timer.metrics() == {"time/step": 0.0}


def test_progress_line_and_eta():
    line = format_progress(
        25, 100, {"reward/mean": 0.4215, "success_rate": 0.375, "tokens_per_s": 12345.0}, 2.0, 20
    )
    assert line == (
        "step 25/100 [#####...............]  25% | reward 0.421 | success 0.375 | "
        "12.3k tok/s | 2.00 s/step | ETA 2m30s"
    )
    assert format_progress(0, 10, {}, None).endswith("ETA ?")
    assert [format_duration(s) for s in (5, 65, 7325, float("nan"))] == [
        "5s",
        "1m05s",
        "2h02m",
        "?",
    ]


def test_progress_bar_counts_only_steps_run_here():
    now = [100.0]
    out = io.StringIO()
    bar = ProgressBar(10, start_step=4, stream=out, clock=lambda: now[0], is_tty=False)
    for step in (5, 6):
        now[0] += 3.0
        bar.update(step, {"reward/mean": 1.0})
    assert bar.seconds_per_step(6) == 3.0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].endswith("3.00 s/step | ETA 12s")


def test_progress_bar_redraws_in_place_on_a_terminal():
    out = io.StringIO()
    bar = ProgressBar(2, stream=out, is_tty=True, clock=lambda: 0.0)
    bar.update(1, {})
    bar.write("eval: success 0.5")
    bar.update(2, {})
    text = out.getvalue()
    assert text.startswith("\rstep 1/2") and "eval: success 0.5\n" in text
    assert text.endswith("\n") and text.count("\rstep") == 2


def _synthetic_run(run_dir, steps=24):
    """What the RL loop writes: rewards rising, contexts growing per turn, a layout change."""
    with MetricsLogger(run_dir, tensorboard=False) as log:
        for step in range(1, steps + 1):
            ctx = 100 + 8 * step
            big = step > steps // 2
            log.log(
                step,
                {
                    "reward/mean": min(1.0, 0.1 + 0.035 * step),
                    "reward/std": 0.2,
                    "success_rate": min(1.0, 0.05 + 0.04 * step),
                    "response_len/mean": 30 + step,
                    "context_len/mean": ctx,
                    "context_len/max": 2 * ctx,
                    **{f"context_len_per_turn/{t}": ctx * (t + 1) / 3 for t in range(3)},
                    "time/rollout": 2.0 + 0.1 * step,
                    "time/experience": 0.5,
                    "time/train": 1.0,
                    "time/step": 3.6 + 0.1 * step,
                    "layout/rollout": "tp1cp1pp1dp2",
                    "layout/experience": "tp2cp1pp1dp1",
                    "layout/train": "tp2cp1pp1dp1" if big else "tp1cp1pp1dp2",
                    "tokens_per_s": 900.0,
                    "train/loss": 0.1,
                    **({"eval/success_rate": 0.3 + 0.02 * step} if step % 8 == 0 else {}),
                },
            )


def test_plot_draws_every_figure(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from megatron_earl.orchestration.plot import main

    _synthetic_run(tmp_path / "run")
    assert main([str(tmp_path / "run")]) == 0
    names = sorted(p.name for p in (tmp_path / "run" / "plots").iterdir())
    assert names == ["layouts.png", "lengths.png", "reward.png", "time.png"]
    for name in names:
        path = tmp_path / "run" / "plots" / name
        assert path.stat().st_size > 10_000, name
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 300 and image.shape[1] >= 700, (name, image.shape)
        colours = image[..., :3].reshape(-1, 3)
        assert colours.std() > 0.05, name  # not a blank canvas
        assert (colours[:, 0] - colours[:, 2]).__abs__().max() > 0.3, name  # coloured lines drawn


def test_plot_skips_figures_without_data_and_reports_missing_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from megatron_earl.orchestration.plot import main

    with MetricsLogger(tmp_path / "run", tensorboard=False) as log:
        log.log(1, {"reward/mean": 0.5})
        log.log(2, {"reward/mean": 0.7})
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["reward.png"]
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
