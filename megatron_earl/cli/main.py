"""The ``megatron-earl`` command: one subcommand per entry point of the project.

    megatron-earl smoke --nproc 2 --layout tp2      # multi-process CPU training smoke run
    megatron-earl train --nproc 2 --config configs/demo_cpu.yaml [key=value ...]   # RL run
    megatron-earl bench dispatch [--json]           # dispatcher: decentralized vs centralized
    megatron-earl bench reshard [--against megatron-core]   # resharding vs all-gather / mcore
    megatron-earl bench engine                      # embedded engine vs HF generate, tokens/s
    megatron-earl bench peer [--pairs 3]            # the same GRPO workload: ours vs TRL
    megatron-earl bench serve [--sources A,B]       # serve under 32 concurrent clients: p50/p99
    megatron-earl bench soak [--duration-s 60]      # serve under normal + hostile clients
    megatron-earl bench async-sim [--json]          # simulated sync vs async, 64-1024 GPUs
    megatron-earl bench async [--pace-ms 30]        # paced engines: real sync vs async runs
    megatron-earl bench relay [--engines 2,4,8]     # trainer stall per publish: relays vs direct
    megatron-earl bench faults                      # async run with relays under injected faults
    megatron-earl bench repack [--plot F.png]       # paced: repack vs drain vs none, utilisation
    megatron-earl bench host-syncs [--sites 5]      # device->host syncs per step kind (emulated)
    megatron-earl serve --port 30000 ...            # embedded engine behind SGLang's HTTP API
    megatron-earl relay --port 31000 [--upstream URL] [--engines URL,...]   # weight relay
    megatron-earl plot RUN_DIR                      # PNG plots of a run's metrics
    megatron-earl plan --model qwen2.5-7b --gpus 32 --gpu-memory 80 --context 4k,64k
    megatron-earl plan CONFIG --gpu h100-80gb           # per-phase peak memory, or refused
    megatron-earl bench selector                    # context-length sweep: selector vs static
    megatron-earl bench-rl-sweep --nproc 2          # the RL loop with growing contexts, ditto
    megatron-earl convert hf-to-mcore --hf DIR --out DIR   (or mcore-to-hf --ckpt DIR --out DIR)

Subcommands that start processes go through ``torchrun`` (the same launcher users run under
slurm); the others call the component's own ``main(argv)``.

Stopping (``stop_run``): SIGTERM, SIGINT or SIGHUP to this command is passed on to every worker
as SIGTERM (torchrun runs in its own session, so a terminal's Ctrl-C reaches only this command);
the workers stop at once, or, with ``checkpoint.on_signal``, at the end of the step after a
checkpoint. Whatever is still running after the grace time (``checkpoint.on_signal_grace_s``
with on_signal, else ``STOP_GRACE_S``), or at a second signal, is killed: torchrun and every
process it started. torchrun dies with this command (``PR_SET_PDEATHSIG``), so even a SIGKILL
here stops the run.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time

from megatron_earl.cli.train import ERROR_FILE_ENV, resolve_config
from megatron_earl.compat.processes import die_with_parent, skip_exit_gc

# subcommand -> module whose ``main(argv)`` implements it
_MODULES = {
    ("bench", "dispatch"): "megatron_earl.bench.dispatch",
    ("bench", "reshard"): "megatron_earl.bench.reshard",
    ("bench", "engine"): "megatron_earl.bench.engine",
    ("bench", "serve"): "megatron_earl.bench.serve",
    ("bench", "soak"): "megatron_earl.bench.soak",
    ("serve",): "megatron_earl.rollout.serve.server",
    ("relay",): "megatron_earl.rollout.weights.relay.server",
    ("plot",): "megatron_earl.orchestration.plot",
    ("plan",): "megatron_earl.selector.plan_cli",
    ("convert",): "megatron_earl.convert.cli",
    ("bench", "selector"): "megatron_earl.bench.selector",
    ("bench", "peer"): "megatron_earl.bench.peer",
    ("bench", "async-sim"): "megatron_earl.bench.async_sim",
    ("bench", "async"): "megatron_earl.bench.async_rl",
    ("bench", "relay"): "megatron_earl.bench.relay",
    ("bench", "faults"): "megatron_earl.bench.fault_suite",
    ("bench", "repack"): "megatron_earl.bench.repack",
    ("bench", "host-syncs"): "megatron_earl.bench.host_syncs",
}
_TORCHRUN = {
    "smoke": "megatron_earl.cli.smoke",
    "train": "megatron_earl.cli.train",
    "bench-rl-sweep": "megatron_earl.bench.rl",
}
_RUNNERS = {"train": "megatron_earl.cli.checked_torchrun"}
"""torchrun itself for every subcommand but these: ``train`` starts its workers only after every
start-up check of the run passed (``cli.checked_torchrun``, in torchrun's own process: this
launcher imports no ``torch``)."""


STOP_GRACE_S = 30.0
"""Seconds the launcher waits, after passing a signal on, before it kills what is left (without
``checkpoint.on_signal``: the workers exit at once)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that stop a run started by this command."""


def _torchrun(
    module: str,
    argv: list[str],
    grace_s: float = STOP_GRACE_S,
    runner: str = "torch.distributed.run",
) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        error_file = os.path.join(tmp, "error.txt")
        rc = _torchrun_to(module, argv, {ERROR_FILE_ENV: error_file}, grace_s, runner)
        if rc and os.path.exists(error_file):
            with open(error_file) as f:
                print(f"megatron-earl {module.rsplit('.', 1)[-1]}: {f.read()}", file=sys.stderr)
    return rc


class UsageError(ValueError):
    """A command-line argument this launcher cannot take; the message names it."""


def _pop_nproc(argv: list[str]) -> tuple[int, list[str]]:
    """(``--nproc`` value, default 2; the arguments without it). ``UsageError`` names a missing
    or non-positive-integer value."""
    if "--nproc" not in argv:
        return 2, argv
    i = argv.index("--nproc")
    value = argv[i + 1] if i + 1 < len(argv) else None
    if value is None or not value.isdigit() or int(value) < 1:
        raise UsageError(f"--nproc takes a number of processes >= 1, got {value!r}")
    return int(value), argv[:i] + argv[i + 2 :]


def _torchrun_to(
    module: str,
    argv: list[str],
    extra_env: dict[str, str],
    grace_s: float = STOP_GRACE_S,
    runner: str = "torch.distributed.run",
) -> int:
    nproc, argv = _pop_nproc(argv)
    cmd = [
        sys.executable,
        "-m",
        runner,
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *argv,
    ]
    env = {**os.environ, **extra_env}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_terminate_with_parent)
    return stop_run(proc, grace_s)


def stop_run(proc: subprocess.Popen, grace_s: float) -> int:
    """Wait for torchrun ``proc``; on a ``STOP_SIGNALS`` signal pass SIGTERM to its workers,
    and kill everything left after ``grace_s`` or at a second signal (module docstring).
    Returns torchrun's exit code, or 128 + the signal's number after a signal."""
    import psutil

    received: list[int] = []  # signal numbers, in order
    first_at = 0.0  # monotonic time of the first
    seen: dict[int, psutil.Process] = {}

    def descendants() -> list[psutil.Process]:
        try:
            found = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        seen.update({p.pid: p for p in found})
        return found

    def on_signal(signum: int, frame) -> None:
        nonlocal first_at
        received.append(signum)
        if len(received) > 1:
            return  # the wait loop kills
        first_at = time.monotonic()
        print(
            f"megatron-earl: {signal.Signals(signum).name}: stopping the run (a second signal "
            f"kills it at once; killed in any case after {grace_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        for child in descendants():
            with _gone_ok():
                if child.ppid() == proc.pid:  # a worker (not a worker's own child)
                    child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        while proc.poll() is None:
            if len(received) > 1 or (received and time.monotonic() - first_at > grace_s):
                break
            if received:
                descendants()  # remember them: orphans cannot be found from torchrun later
            time.sleep(0.1)
        if received:
            _kill_all(proc, [*seen.values(), *descendants()])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else proc.returncode


def _kill_all(proc: subprocess.Popen, processes: list) -> None:
    """SIGKILL torchrun and every process it started that is still alive; reap torchrun."""
    import psutil

    for p in [proc, *processes]:
        with _gone_ok():
            p.kill()
    proc.wait()
    psutil.wait_procs(processes, timeout=10)


class _gone_ok(contextlib.AbstractContextManager):
    """Ignore a process that has exited meanwhile."""

    def __exit__(self, kind, value, tb) -> bool:
        import psutil

        return kind is not None and issubclass(kind, psutil.NoSuchProcess | ProcessLookupError)


def _terminate_with_parent() -> None:
    """In torchrun (before exec): receive SIGTERM when this launcher dies, whatever killed it
    (Linux ``PR_SET_PDEATHSIG``; torchrun then stops its workers)."""
    die_with_parent(signal.SIGTERM)


def _usage() -> str:
    names = sorted([*_TORCHRUN, *(" ".join(k) for k in _MODULES)])
    return "usage: megatron-earl {" + ", ".join(names) + "} [args...]"


def main(argv: list[str] | None = None) -> int:
    skip_exit_gc()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    try:
        return _dispatch(argv)
    except UsageError as err:
        print(f"megatron-earl {argv[0]}: {err}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    grace_s = STOP_GRACE_S
    if argv[0] == "train":
        # The config (for the stop grace time); the whole run is validated before any worker
        # starts, in torchrun's process (_RUNNERS).
        from megatron_earl.config.run import ConfigError

        nproc, plain = _pop_nproc(argv[1:])
        try:
            config = resolve_config(plain, nproc)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        if config.checkpoint.on_signal:
            grace_s = config.checkpoint.on_signal_grace_s
    if argv[0] in _TORCHRUN:
        runner = _RUNNERS.get(argv[0], "torch.distributed.run")
        return _torchrun(_TORCHRUN[argv[0]], argv[1:], grace_s, runner)
    for words, module in _MODULES.items():
        if tuple(argv[: len(words)]) == words:
            return int(importlib.import_module(module).main(argv[len(words) :]) or 0)
    print(f"megatron-earl: unknown command {' '.join(argv[:2])!r}\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
