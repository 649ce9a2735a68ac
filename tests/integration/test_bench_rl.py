"""`megatron-earl bench-rl-sweep` end to end on a short sweep (2 steps, contexts that fit every
layout), so the benchmark behind the selector's figures keeps running: three runs complete,
the report has its per-bucket table, the paired comparison and the memory model's error line.
The figures themselves are the benchmark's business (docs/selector.md), not this test's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_rl_sweep_runs_and_reports(tmp_path):
    command = [sys.executable, "-m", "megatron_earl.cli.main", "bench-rl-sweep", "--nproc", "2"]
    args = ["--steps", "2", "--max-difficulty", "2", "--sft-steps", "2"]
    args += ["--jsonl", str(tmp_path / "steps.jsonl")]
    result = subprocess.run(
        [*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for name in ("selector", "static tp1cp1pp1dp2", "static tp2cp1pp1dp1"):
        assert re.search(rf"^{re.escape(name)}\s+2\s+0\s", out, re.M), out
    assert "selector vs each static layout on the same steps" in out
    assert re.search(r"memory model, predicted before each run vs measured, \d+ phase runs", out)
    assert "profiled 16 runs" in out
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 6
