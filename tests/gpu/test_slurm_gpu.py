"""The two-node launch path on one GPU machine: ``sbatch --nodes=2 scripts/slurm_colocated.sbatch``
under a fake slurm whose ``srun`` starts ``scripts/torchrun_node.sh`` once per "node", at the
same time, each with its own GPU (``CUDA_VISIBLE_DEVICES``, as slurm binds a node's GPUs) and
the ``SLURM_*`` of its task; the real ``torchrun`` then runs with ``--nnodes=2``,
``--nproc-per-node=1`` and the node ranks from slurm, rendezvous at the first host of the node
list, and the two ranks run 2 steps of the switching demo (train and experience in tp2 across
the two "nodes": NCCL between them), to the end: the metrics of both steps are written and
finite. The fake ``sbatch`` and ``scontrol`` are tests/unit/test_scripts.py's (which checks the
commands these scripts build with ``torchrun`` itself faked); the node list is ``localhost``
twice, so the master address resolves here."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_earl.testing.distributed import free_port
from tests.gpu import requires_gpus, visible_gpus
from tests.gpu.test_demo_gpu import TINY
from tests.unit.test_scripts import FAKES

pytestmark = [pytest.mark.gpu, requires_gpus(2)]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900
"""The whole job: the pre-flight check, two torchruns, start-up, SFT, evaluations, 2 steps."""

SRUN = r"""#!/usr/bin/env bash
# fake srun: one task per node, all at once; task t is node t with the t-th GPU of FAKE_GPUS.
# Like --kill-on-bad-exit, a task that fails stops the others.
IFS=, read -ra gpus <<< "$FAKE_GPUS"
ntasks=1
while [[ $# -gt 0 && $1 == -* ]]; do
    [[ $1 == --ntasks=* ]] && ntasks=${1#--ntasks=}
    shift
done
pids=()
for (( t = 0; t < ntasks; t++ )); do
    SLURM_PROCID=$t SLURM_NODEID=$t SLURM_LOCALID=0 SLURM_NTASKS=$ntasks \
        SLURM_STEP_NUM_TASKS=$ntasks CUDA_VISIBLE_DEVICES=${gpus[$t]} "$@" &
    pids+=($!)
done
rc=0
for (( t = 0; t < ntasks; t++ )); do
    wait -n; status=$?
    if (( status != 0 && rc == 0 )); then
        rc=$status
        kill "${pids[@]}" 2>/dev/null
    fi
done
exit $rc
"""
SBATCH = FAKES["sbatch"].replace(
    'export SLURM_JOB_NODELIST="node[01-$(printf %02d "$nodes")]"',
    'export SLURM_JOB_NODELIST=$(printf "localhost,%.0s" $(seq "$nodes")); '
    "SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST%,}",
)


def _torchrun() -> str:
    """The torchrun of this interpreter's environment."""
    beside = Path(sys.executable).with_name("torchrun")
    found = str(beside) if beside.exists() else shutil.which("torchrun")
    if found is None:
        pytest.fail(f"no torchrun beside {sys.executable} or on PATH")
    return found


def test_sbatch_runs_two_nodes_of_one_gpu_to_the_end(tmp_path):
    assert SBATCH != FAKES["sbatch"], "tests/unit/test_scripts.py's fake sbatch changed"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"sbatch": SBATCH, "scontrol": FAKES["scontrol"], "srun": SRUN}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "MASTER_", "CUDA_VISIBLE", "GLOO_SOCKET", "NCCL_SOCKET"))
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        FAKE_LOG=str(tmp_path / "calls.jsonl"),
        FAKE_PYTHON=sys.executable,
        PYTHON=sys.executable,
        TORCHRUN=_torchrun(),
        FAKE_GPUS=",".join(visible_gpus()[:2]),
        GPUS_PER_NODE="1",
        MASTER_PORT=str(free_port()),
    )
    config = "configs/demo_cpu_switching.yaml"
    argv = ["sbatch", "--nodes=2", "scripts/slurm_colocated.sbatch", config, *TINY,
            f"output_dir={tmp_path}", "name=two_nodes"]  # fmt: skip
    # its own session: on a timeout every process of the job (torchruns, ranks) is killed
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end within {TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "slurm_colocated: 2 node(s) x 1 = 2 ranks, master localhost:" in out
    assert "config ok" in out  # the pre-flight check ran for 2 ranks
    lines = (tmp_path / "two_nodes" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert all(math.isfinite(v) for v in s.values() if isinstance(v, float)), s
