"""The trainer on SGLang-protocol engines (``tests/integration/test_trainer_sglang.py``: rank-0
gather of the full weights from the training layout, push over HTTP, rollouts through the
engines) run whole under the emulation tier: the trainer's ranks and the engine servers compute on
the emulated device, so the gather of device shards and the host boundary before HTTP are
checked as on GPUs. Two of its runs: the colocated tensor push (the engines release and resume
device memory around it) and the distributed push behind the router; the other protocols differ
only after the gather, on host tensors. Run in its own pytest process: the emulated device is
process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.emulation.common import EMULATED

ROOT = Path(__file__).resolve().parents[2]


def test_sglang_weight_push_runs_on_the_emulated_device():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/integration/test_trainer_sglang.py", "-k", "tensor-True or distributed"],
        cwd=ROOT,
        env={**os.environ, **EMULATED},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]
