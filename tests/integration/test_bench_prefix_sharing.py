"""``scripts/bench_prefix_sharing.py`` (the figures in docs/training.md, "Prefix-shared packing")
runs end to end on a tiny case and prints the tokens each packing computes, and with ``--hf``
the positions and time of Hugging Face's train step on TRL's padded batch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_the_benchmark_script_prints_both_packings():
    """``scripts/bench_prefix_sharing.py`` (the figures in docs/training.md) runs end to end."""
    root = Path(__file__).resolve().parents[2]
    args = ["scripts/bench_prefix_sharing.py", "--rounds", "1", "--cases", "3:4:2:2", "--hf"]
    result = subprocess.run(
        [sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.splitlines()[-1]
    assert line.startswith("prompt 3, completions <= 4, 2 groups x 2: tokens whole ")
    whole, tree = (int(n) for n in re.findall(r"tokens whole (\d+), tree (\d+)", line)[0])
    assert whole - tree == 2 * 2  # per group, the 2 shared tokens are saved once
    assert len(re.findall(r"\(\d+\.\d+x\)", line)) == 2
    # --hf: TRL's padded batch, 4 samples x (prompt 3 + the longest completion)
    (positions,) = re.findall(r"HF train step \(TRL's padded batch\) (\d+) positions", line)
    longest = max(int(n) for n in re.findall(r"completions <= (\d+)", line))
    assert whole <= int(positions) <= 4 * (3 + longest)
    assert re.search(r"\(HF / tree \d+\.\d+x\)$", line), line
