"""The demo's RL step end to end on the emulated device, as users run it (``megatron-earl train``,
2 processes; the switching demo config, whose layouts are pinned): warm start, evaluation,
multi-turn rollouts on the embedded engine in dp2, dispatch to tp2, experience, training, the
reshard back and the weight push to the engine. Every tensor path runs on the device and every
collective on a group of the right role, or the run fails.

Checked: the run completes and says it ran on the emulated device; the train step packed prefix
trees (``train/num_shared_tokens`` > 0); the engine's log-probs after the first update match the
trainer's (so the pushed weights reached the engine); the final checkpoint is written from device
tensors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tests.emulation.common import EMULATED
from tests.integration.metrics_doc import check_documented
from tests.tolerances import fp32_tol, gpt_terms

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "steps=2",
    "sft.steps=2",
    "eval.num_prompts=4",
    "eval.interval=2",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "logging.tensorboard=false",
    "logging.progress=false",
    # every group of these 2 steps has equal rewards: with the skip on, the train phase would run
    # on one sample and no prefix tree (checked below); the skip's device path is covered by
    # test_emulated_rl_step.py::test_zero_advantage_skip_on_the_emulated_device
    "train.skip_zero_advantage=false",
]


def test_demo_rl_steps_run_on_the_emulated_device(tmp_path):
    from megatron_earl.config.loader import load_config

    config = load_config("configs/demo_cpu_switching.yaml", TINY)
    command = [
        sys.executable, "-m", "megatron_earl.cli.main", "train", "--nproc", "2",
        "--config", "configs/demo_cpu_switching.yaml", *TINY, f"output_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, **EMULATED},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "device: emu:0 (emulated device); device groups gloo (tagged as NCCL)" in proc.stdout
    (metrics_file,) = tmp_path.glob("*/metrics.jsonl")
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    last = records[-1]
    assert last["layout/rollout"] == "tp1cp1pp1dp2" and last["layout/train"] == "tp2cp1pp1dp1"
    assert last["weight_version"] == records[0]["weight_version"] + 1  # one push per step
    assert all(math.isfinite(last[k]) for k in ("train/loss", "train/grad_norm", "adv/std"))
    # each group's prompt packed once (prefix-shared tree rows) on the device
    assert all(r["train/num_shared_tokens"] > 0 for r in records)
    # Rollout log-probs (engine, after the step-1 weight push) against the trainer's: a mean of
    # per-token differences within a forward's fp32 bound (|log-prob|, |logit| < 10 here: ~3e-3;
    # observed ~2e-7); an engine on other weights than the trainer's is O(0.1) off
    bound = fp32_tol(gpt_terms(config.model, config.rollout.max_context), 10.0)
    assert last["rollout/logprob_mismatch"] <= bound
    check_documented(records, {"eval"})
    assert (metrics_file.parent / "checkpoints" / "iter_0000002").is_dir()  # saved from the device
