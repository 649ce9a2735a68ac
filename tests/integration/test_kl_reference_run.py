"""The trainer with a KL term to the frozen reference policy (``train.loss.kl_coef > 0``), as users
run it (``megatron-earl train`` -> torchrun, 2 processes, the switching demo config made tiny:
experience and train pinned to tp2, the reference policy in tp2):

- the run completes and logs the KL metrics every step: ``train/kl_ref`` (token mean of the
  estimator against the reference) and ``train/kl_loss``, finite, ~0 at step 1 (the reference is
  the policy the first step starts from) and > 0 after it;
- the reference survives resume: a run stopped after its step-2 checkpoint and resumed to step 3
  logs the same step-3 metrics (KL included) as an uninterrupted 3-step run; had the resumed run
  taken the resumed policy as its reference, its step-3 KL would be ~0;
- the selector choosing the experience layout with a KL term fails at start-up, naming both.

Metrics compared like ``test_trainer.py``: everything but wall-clock figures, rel 1e-5.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_cpu_switching.yaml"  # pinned layouts: the reference stays in tp2
TINY = [
    "sft.steps=10",
    "eval.num_prompts=0",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "checkpoint.interval=1",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "logging.tensorboard=false",
    "logging.progress=false",
    "train.loss.kl_coef=0.001",
]
WALL_CLOCK = (
    "time/",
    "time_busy/",
    "tokens_per_s",
    "train/tokens_per_s",
    "sync/reshard_s",
    "sync/weight_push_s",
    "sync/weight_transfer_s",
)


def _run(config: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_earl.cli.main", "train", "--nproc", "2"]
    return subprocess.run(
        [*command, "--config", str(config), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    result = _run(DEMO, [*TINY, "steps=3", f"output_dir={out}", "name=full"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "full"


def test_kl_metric_is_logged_and_positive_after_step_1(full_run):
    records = _metrics(full_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["train/kl_ref"]) and math.isfinite(r["train/kl_loss"])
    assert abs(records[0]["train/kl_ref"]) < 1e-8  # step 1: the policy is the reference
    for r in records[1:]:
        assert r["train/kl_ref"] > 1e-8 and r["train/kl_loss"] > 1e-8
    assert (full_run / "checkpoints" / "reference" / "latest").exists()


def test_reference_survives_resume(full_run, tmp_path):
    first = _run(DEMO, [*TINY, "steps=2", f"output_dir={tmp_path}", "name=resumed"])
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "resumed"
    resumed = _run(run_dir / "config.yaml", ["steps=3"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _metrics(run_dir), _metrics(full_run)
    assert [r["step"] for r in got] == [1, 2, 3]
    for key, value in want[2].items():
        if key.startswith(WALL_CLOCK):
            continue
        if isinstance(value, float):
            assert math.isclose(got[2][key], value, rel_tol=1e-5, abs_tol=1e-7), key
        else:
            assert got[2][key] == value, key
    assert got[2]["train/kl_ref"] > 1e-8


def test_kl_with_the_selector_choosing_the_experience_layout_fails_at_start_up(tmp_path):
    result = _run(DEMO, [*TINY, f"output_dir={tmp_path}", "selector.enabled=true"])
    assert result.returncode != 0
    assert "train.loss.kl_coef=0.001" in result.stderr
    assert "selector.phases" in result.stderr
    assert not (tmp_path / "demo_cpu_switching" / "metrics.jsonl").exists()
