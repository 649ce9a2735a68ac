"""Hangs, signals and kills of a real run (``megatron-earl train --nproc 2``, tiny model), with
every process of the run followed (the launcher's descendants, found with psutil):

- a stopped worker (SIGSTOP) is named by the watchdog (rank, activity, step) and the job ends
  within a bounded time, no process left;
- SIGTERM to the launcher stops torchrun and every worker; with ``checkpoint.on_signal`` the
  ranks first finish the step and save a checkpoint; SIGKILL of the launcher stops them too;
- SIGKILL of rank 0 while its checkpoint writers run leaves no writer behind.

Each run costs ~15 s of start-up on 2 cores; the model is the smallest that keeps the phases
real.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "steps=500",  # never reached: every test ends the run
    "sft.steps=0",
    "eval.num_prompts=0",
    "batch.prompts_per_step=2",
    "batch.samples_per_prompt=2",
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "selector.enabled=false",
    "logging.tensorboard=false",
    "logging.progress=false",
]


class Run:
    """A ``megatron-earl train`` run and every process it started (remembered as they appear,
    so that orphans are still known after their parent is gone)."""

    def __init__(self, tmp_path: Path, overrides: list[str]) -> None:
        self.dir = tmp_path / "r"
        self.stderr_path = tmp_path / "stderr.txt"
        self.stdout_path = tmp_path / "stdout.txt"
        self.launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_earl.cli.main",
                "train",
                "--nproc",
                "2",
                "--config",
                str(ROOT / "configs" / "demo_cpu.yaml"),
                *TINY,
                *overrides,
                f"output_dir={tmp_path}",
                "name=r",
            ],
            cwd=ROOT,
            stdout=self.stdout_path.open("w"),
            stderr=self.stderr_path.open("w"),
            start_new_session=True,
        )
        self.seen: dict[int, psutil.Process] = {}

    def processes(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.launcher.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        self.seen.update({p.pid: p for p in found})
        return found

    def worker(self, rank: int) -> psutil.Process | None:
        for p in self.processes():
            try:
                if "megatron_earl.cli.train" in p.cmdline() and p.environ().get("RANK") == str(
                    rank
                ):
                    return p
            except psutil.Error:
                continue
        return None

    def wait_until(self, what: str, predicate, timeout_s: float = 240, poll_s: float = 0.05):
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            assert self.launcher.poll() is None, f"the run ended before {what}: {self.stderr()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
            time.sleep(poll_s)

    def heartbeat(self, rank: int) -> dict | None:
        try:
            return json.loads((self.dir / "heartbeat" / f"rank_{rank}.json").read_text())
        except (OSError, ValueError):
            return None

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-3000:]

    def alive(self) -> list[psutil.Process]:
        self.processes()
        out = []
        for p in [*self.seen.values()]:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out

    def assert_nothing_left(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, p.status()) for p in self.alive()]
        assert not left, f"processes of the run still alive {within_s} s later: {left}"

    def cleanup(self) -> None:
        """Kill whatever a failed test left (the launcher first: it would restart nothing)."""
        if self.launcher.poll() is None:
            self.launcher.kill()
        for p in self.alive():
            try:
                p.kill()
            except psutil.Error:
                pass
        self.launcher.wait(timeout=30)


@pytest.fixture
def run(tmp_path):
    started: list[Run] = []

    def start(overrides: list[str]) -> Run:
        started.append(Run(tmp_path, overrides))
        return started[-1]

    yield start
    for r in started:
        r.cleanup()


def _steps_logged(run: Run) -> int:
    try:
        return len((run.dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_stopped_worker_is_named_and_the_job_ends(run):
    r = run(["runtime.watchdog_timeout_s=5", "runtime.collective_timeout_s=600"])
    r.wait_until("step 2", lambda: _steps_logged(r) >= 2)
    worker = r.worker(1)
    r.processes()
    worker.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    rc = r.launcher.wait(timeout=90)
    took = time.monotonic() - stopped
    err = r.stderr()
    assert rc != 0
    assert f"watchdog: rank 1 (pid {worker.pid}" in err, err
    assert "stopped or frozen in '" in err and "of step " in err, err
    assert took < 60, f"the job took {took:.0f} s to end after the stop"
    r.assert_nothing_left(within_s=20)


def test_sigterm_to_the_launcher_stops_every_process(run):
    r = run([])
    r.wait_until("step 2", lambda: _steps_logged(r) >= 2)
    r.processes()
    r.launcher.send_signal(signal.SIGTERM)
    rc = r.launcher.wait(timeout=60)
    r.assert_nothing_left(within_s=20)
    assert rc == 128 + signal.SIGTERM


def test_sigkill_of_the_launcher_stops_every_process(run):
    """torchrun dies with the launcher (PR_SET_PDEATHSIG: SIGTERM) and stops its workers."""
    r = run([])
    r.wait_until("step 2", lambda: _steps_logged(r) >= 2)
    r.processes()
    r.launcher.send_signal(signal.SIGKILL)
    r.launcher.wait(timeout=10)
    r.assert_nothing_left(within_s=40)


def test_sigterm_with_on_signal_saves_a_final_checkpoint(run):
    r = run(["checkpoint.on_signal=true", "checkpoint.interval=0"])
    r.wait_until("step 2", lambda: _steps_logged(r) >= 2)
    r.processes()
    r.launcher.send_signal(signal.SIGTERM)
    rc = r.launcher.wait(timeout=120)
    r.assert_nothing_left(within_s=20)
    assert rc == 128 + signal.SIGTERM
    latest = (r.dir / "checkpoints" / "latest").read_text().strip()
    metrics = (r.dir / "metrics.jsonl").read_text().splitlines()
    last = json.loads(metrics[-1])["step"]
    assert latest == f"iter_{last:07d}", (latest, last)  # saved at the last step run
    assert f"stopped by SIGTERM after step {last}" in r.stdout_path.read_text()


def test_sigkill_of_rank0_mid_checkpoint_leaves_no_writer(run):
    """Rank 0 is killed while it waits for its writers: the writers are held (SIGSTOP) as soon
    as they appear, as a slow write would hold them, rank 0 is killed, and they go on (SIGCONT).
    Before the fix each finished its file, then waited forever for the dead rank."""
    r = run(["checkpoint.interval=1", "checkpoint.keep_last=1"])
    rank0 = r.wait_until("rank 0", lambda: r.worker(0))

    def children() -> list[psutil.Process]:
        try:
            return rank0.children()
        except psutil.Error:
            return []

    writers = r.wait_until("a checkpoint writer of rank 0", children, poll_s=0.002)
    held: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 1.0  # rank 0 starts every writer, then waits for them
    while time.monotonic() < deadline:
        for w in writers:
            if w.pid not in held:
                w.suspend()
                held[w.pid] = w
        writers = children()
        time.sleep(0.01)
    rank0.kill()
    r.seen.update(held)
    for w in held.values():
        try:
            w.resume()
        except psutil.Error:
            pass
    r.launcher.wait(timeout=90)
    r.assert_nothing_left(within_s=20)
