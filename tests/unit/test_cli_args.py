"""The launcher's own arguments: a bad ``--nproc`` is one line naming the value (exit 2), not a
traceback, and no process starts (issue 22, item 9)."""

from __future__ import annotations

import pytest

from megatron_earl.cli.main import main


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (["--nproc", "abc"], "'abc'"),
        (["--nproc", "0"], "'0'"),
        (["--nproc", "-2"], "'-2'"),
        (["--nproc"], "None"),
    ],
)
@pytest.mark.parametrize("command", ["train", "smoke"])
def test_bad_nproc_is_named(command, args, value, capsys):
    rc = main([command, "--config", "configs/demo_cpu.yaml", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"megatron-earl {command}: --nproc takes a number of processes >= 1, got {value}" in err
    assert "Traceback" not in err


LAUNCH_WITHOUT_TORCH = """
import subprocess, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("the launcher imported " + name)

sys.meta_path.insert(0, NoTorch())

class Started(Exception):
    pass

def popen(cmd, **kwargs):
    print(" ".join(cmd[1:6]))
    raise Started

subprocess.Popen = popen
from megatron_earl.cli.main import main
try:
    main(sys.argv[1:])
except Started:
    sys.exit(0)
sys.exit(1)
"""


def test_train_launcher_imports_no_torch_and_starts_the_checked_torchrun():
    """``megatron-earl train`` reads the config without ``torch`` (one import fewer per run) and
    hands the whole run's validation to torchrun's own process (``cli.checked_torchrun``)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            LAUNCH_WITHOUT_TORCH,
            "train",
            "--nproc",
            "2",
            "--config",
            "configs/demo_cpu.yaml",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [
        "-m",
        "megatron_earl.cli.checked_torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
    ]


def test_checked_torchrun_reads_the_ranks_and_the_modules_arguments():
    from megatron_earl.cli.checked_torchrun import split_torchrun_argv

    argv = ["--standalone", "--nproc_per_node=4", "-m", "megatron_earl.cli.train", "--config", "c"]
    assert split_torchrun_argv(argv) == (4, ["--config", "c"])
    with pytest.raises(ValueError, match="no -m MODULE"):
        split_torchrun_argv(["--standalone", "--nproc_per_node=4"])
    with pytest.raises(ValueError, match="--nproc_per_node=N with N >= 1"):
        split_torchrun_argv(["--nproc_per_node=0", "-m", "m"])
