"""The trainer with the parallelism selector on (``selector.enabled=true``), as users run it
(``megatron-earl train`` -> torchrun, 2 processes):

- the experience layout is chosen per step under a CPU memory budget of 3.2 MiB per rank with no
  safety margin: the first choice (dp2, predicted 3.1 MiB) measures ~3.3 MiB on the guessing game's
  long contexts, runs out of budget, and the same batch is re-run in the next candidates until one
  fits; every step completes, every decision is in the metrics, and no sample is lost;
- a budget every layout exceeds on the real batch ends the run with one message (the selector's),
  repeated as the last line of `megatron-earl train`;
- a budget no layout can hold fails at start-up with one message naming the smallest layout and
  the memory it needs, before any process starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_earl.parallel.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "steps=3",
    "sft.steps=3",
    "eval.num_prompts=0",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "batch.max_tokens_per_micro_batch=512",
    "checkpoint.interval=0",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "logging.tensorboard=false",
    "logging.progress=false",
    # long multi-turn contexts: the guessing game at 12 bits, up to 8 turns, 512 tokens
    "env.name=guessing",
    "env.kwargs.difficulty=12",
    "rollout.max_turns=8",
    "rollout.max_context=512",
    "selector.enabled=true",
]


def _train(overrides: list[str], timeout: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_earl.cli.main", "train", "--nproc", "2"]
    return subprocess.run(
        [*command, "--config", str(ROOT / "configs" / "demo_cpu.yaml"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_experience_layout_recovers_from_an_out_of_budget_phase(tmp_path):
    budget = ["selector.budget_mb=3.2", "selector.safety_margin=0.0"]
    result = _train([*TINY, *budget, f"output_dir={tmp_path}", "name=sel"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "sel" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        layout = r["layout/experience"]
        ParallelLayout.parse(layout)
        assert r["selector/experience/reason"] in (
            "initial",
            "best",
            "keep (hysteresis)",
            "current does not fit",
            "current infeasible",
        )
        attempts = r["selector/experience/attempts"].split(",")
        assert attempts[-1] == f"{layout}:ok"
        assert all(a.endswith(":OOM") for a in attempts[:-1])
        assert r["selector/experience/ooms"] == len(attempts) - 1
        assert r["selector/experience/predicted_mb"] > 0
        assert 0 < r["selector/experience/measured_mb"] <= 3.2
        assert "time/experience" in r and "time/rollout" in r
        # no sample lost: every trajectory of the step reached the experience phase and training
        assert r["selector/experience/samples"] == r["rollout/trajectories"] - r["rollout/failed"]
        assert r["rollout/trajectories"] == 16
    first = records[0]
    assert first["selector/experience/reason"] == "initial"
    assert first["selector/experience/decided"] == "tp1cp1pp1dp2"
    assert first["selector/experience/ooms"] >= 1, "the budget should reject the first choice"
    assert first["layout/experience"] != "tp1cp1pp1dp2"
    # an (layout, length) marked infeasible is not chosen again
    assert all(r["selector/experience/decided"] != "tp1cp1pp1dp2" for r in records[1:])
    assert all(r["selector/experience/ooms"] == 0 for r in records[1:])


def test_budget_below_every_layout_fails_at_start_up(tmp_path):
    result = _train([*TINY, "selector.budget_mb=0.5", f"output_dir={tmp_path}"], timeout=120)
    assert result.returncode == 2
    assert "selector.budget_mb (0.5 MiB) is too small" in result.stderr
    assert "the smallest is tp" in result.stderr and "which needs" in result.stderr
    assert "init_process_group" not in result.stderr
    assert not (tmp_path / "demo_cpu").exists()


def test_every_layout_out_of_budget_ends_the_run_with_one_message(tmp_path):
    # 2 MiB passes the start-up check (tp2 is predicted to need 1.08 MiB) but every layout
    # measures more on the real batch: the run stops with the selector's message, no traceback.
    budget = ["steps=1", "selector.budget_mb=2.0", "selector.safety_margin=0.0"]
    result = _train([*TINY, *budget, f"output_dir={tmp_path}", "name=oom"], timeout=240)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-earl train: selector error: experience step 0: every "), last
    assert "the smallest layout is tp" in last and "MiB" in last and "measured" in last
    assert "Traceback" not in result.stderr.split("selector error", 1)[0]
