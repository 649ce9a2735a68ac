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
