"""Which rank of which world a process is, from its launcher's environment
(``compat.launch_env``), and two processes started as srun starts them (no torchrun) forming one
world of two through ``runtime.initialize``; a task of a multi-task job that cannot name its
master host is refused instead of running as a world of one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_earl.compat.launch_env import LaunchError, launch_env
from megatron_earl.testing.distributed import free_port

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
            "MASTER_PORT": "29500", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}  # fmt: skip
SRUN = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "123456",
        "MASTER_ADDR": "node07"}  # fmt: skip


def test_torchrun_variables_win_over_slurms():
    env = launch_env(TORCHRUN)
    assert env == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
                   "MASTER_PORT": "29500"}  # fmt: skip


def test_srun_tasks_take_their_rank_and_a_port_from_the_job():
    env = launch_env(SRUN)
    assert env == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "node07",
                   "MASTER_PORT": str(20000 + 123456 % 20000)}  # fmt: skip
    assert launch_env({**SRUN, "MASTER_PORT": "31000"})["MASTER_PORT"] == "31000"


def test_a_process_without_a_launcher_is_a_world_of_one():
    one = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "4321"}  # fmt: skip
    assert launch_env({}, lambda: 4321) == one
    assert launch_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"})["WORLD_SIZE"] == "1"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({k: v for k, v in SRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not set"),
        ({**SRUN, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not in [0, SLURM_NTASKS=4)"),
        ({**SRUN, "SLURM_NTASKS": "four"}, "SLURM_NTASKS='four' is not an integer"),
    ],
)
def test_a_task_that_cannot_tell_its_rank_is_refused(env, needle):
    with pytest.raises(LaunchError) as info:
        launch_env(env)
    assert needle in str(info.value)


WORKER = (
    "from megatron_earl import runtime; runtime.initialize(60); "
    "import torch, torch.distributed as d; t = torch.ones(1); d.all_reduce(t); "
    "print(d.get_rank(), d.get_world_size(), int(t))"
)
WATCHDOG = """
import os, time, torch.distributed as d
from megatron_earl.orchestration.watchdog import (
    Heartbeat, StoreBoard, Watchdog, launch_token, rendezvous_store)
stuck = []
board = StoreBoard(rendezvous_store(timeout_s=2.0), launch=launch_token())
w = Watchdog(board, d.get_rank(), 2, timeout_s=1.0, heartbeat=Heartbeat(),
             on_stuck=lambda m, p: stuck.append(m)).start()
time.sleep(2.5)       # longer than the timeout: each rank saw the other's beats, or said so
d.barrier()
print(os.getcwd().rsplit("/", 1)[-1], "stuck:", len(stuck))
w.stop(); d.barrier(); d.destroy_process_group(); os._exit(0)
"""
"""Each task's hang watchdog, with a run directory of its own (node-local disks): the heartbeats
travel through the job's rendezvous store (rank 0 hosts it under plain srun), not files."""


def _srun_task(rank: int, port: int, cwd=None, **extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
               SLURM_JOB_ID="77", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", **extra)  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", WORKER + "\n" + WATCHDOG], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=cwd,
    )  # fmt: skip


def test_two_srun_tasks_without_torchrun_form_one_world_and_watch_each_other(tmp_path):
    port = free_port()
    dirs = [tmp_path / f"node{rank}" for rank in (0, 1)]  # a run directory per node
    for d in dirs:
        d.mkdir()
    tasks = [_srun_task(rank, port, cwd=dirs[rank]) for rank in (0, 1)]
    outs = []
    for task in tasks:
        out, err = task.communicate(timeout=120)
        assert task.returncode == 0, err[-2000:]
        outs.append(out.split()[-6:])
    assert outs == [
        ["0", "2", "2", "node0", "stuck:", "0"],
        ["1", "2", "2", "node1", "stuck:", "0"],
    ]


def test_an_srun_task_without_a_master_is_refused_not_run_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(SLURM_NTASKS="2", SLURM_PROCID="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "LaunchError" in result.stderr and "MASTER_ADDR is not set" in result.stderr
