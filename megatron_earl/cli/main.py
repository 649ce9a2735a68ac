"""The ``megatron-earl`` command: one subcommand per entry point of the project.

    megatron-earl smoke --nproc 2 --layout tp2      # multi-process CPU training smoke run
    megatron-earl train --nproc 2 --config configs/demo_cpu.yaml [key=value ...]   # RL run
    megatron-earl bench dispatch [--json]           # dispatcher: decentralized vs centralized
    megatron-earl bench reshard [--json]            # weight resharding vs all-gather
    megatron-earl bench engine                      # embedded engine vs HF generate, tokens/s
    megatron-earl bench peer [--pairs 3]            # the same GRPO workload: ours vs TRL
    megatron-earl bench serve [--sources A,B]       # serve under 32 concurrent clients: p50/p99
    megatron-earl bench soak [--duration-s 60]      # serve under normal + hostile clients
    megatron-earl bench async-sim [--json]          # simulated sync vs async, 64-1024 GPUs
    megatron-earl bench async [--pace-ms 30]        # paced engines: real sync vs async runs
    megatron-earl bench relay [--engines 2,4,8]     # trainer stall per publish: relays vs direct
    megatron-earl bench faults                      # async run with relays under injected faults
    megatron-earl serve --port 30000 ...            # embedded engine behind SGLang's HTTP API
    megatron-earl relay --port 31000 [--upstream URL] [--engines URL,...]   # weight relay
    megatron-earl plot RUN_DIR                      # PNG plots of a run's metrics
    megatron-earl plan --model qwen2.5-7b --gpus 32 --gpu-memory 80 --context 4k,64k
    megatron-earl bench selector                    # context-length sweep: selector vs static
    megatron-earl bench-rl-sweep --nproc 2          # the RL loop with growing contexts, ditto
    megatron-earl convert hf-to-mcore --hf DIR --out DIR   (or mcore-to-hf --ckpt DIR --out DIR)

Subcommands that start processes go through ``torchrun`` (the same launcher users run under
slurm); the others call the component's own ``main(argv)``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

# subcommand -> module whose ``main(argv)`` implements it
_MODULES = {
    ("bench", "dispatch"): "megatron_earl.dispatch.bench",
    ("bench", "reshard"): "megatron_earl.redistribute.bench",
    ("bench", "engine"): "megatron_earl.rollout.bench",
    ("bench", "serve"): "megatron_earl.rollout.bench_serve",
    ("bench", "soak"): "megatron_earl.rollout.bench_soak",
    ("serve",): "megatron_earl.rollout.server",
    ("relay",): "megatron_earl.relay.server",
    ("plot",): "megatron_earl.orchestration.plot",
    ("plan",): "megatron_earl.selector.plan_cli",
    ("convert",): "megatron_earl.convert.cli",
    ("bench", "selector"): "megatron_earl.selector.bench",
    ("bench", "peer"): "megatron_earl.orchestration.bench_peer",
    ("bench", "async-sim"): "megatron_earl.orchestration.bench_async_sim",
    ("bench", "async"): "megatron_earl.orchestration.bench_async",
    ("bench", "relay"): "megatron_earl.relay.bench",
    ("bench", "faults"): "megatron_earl.orchestration.fault_suite",
}
_TORCHRUN = {
    "smoke": "megatron_earl.cli.smoke",
    "train": "megatron_earl.cli.train",
    "bench-rl-sweep": "megatron_earl.orchestration.bench_rl",
}


ERROR_FILE_ENV = "MEGATRON_EARL_ERROR_FILE"
"""Where ``cli.train`` rank 0 writes a run-ending user error (e.g. the selector's), so that
``megatron-earl train`` repeats it as its last line, after torchrun's failure report."""


def _torchrun(module: str, argv: list[str]) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        error_file = os.path.join(tmp, "error.txt")
        rc = _torchrun_to(module, argv, {ERROR_FILE_ENV: error_file})
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


def _torchrun_to(module: str, argv: list[str], extra_env: dict[str, str]) -> int:
    nproc, argv = _pop_nproc(argv)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *argv,
    ]
    env = {**os.environ, **extra_env}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)


def _usage() -> str:
    names = sorted([*_TORCHRUN, *(" ".join(k) for k in _MODULES)])
    return "usage: megatron-earl {" + ", ".join(names) + "} [args...]"


def main(argv: list[str] | None = None) -> int:
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
    if argv[0] == "train":
        # Validate the whole run before any process (or process group) is started.
        from megatron_earl.cli.train import checked_config
        from megatron_earl.config.run import ConfigError

        nproc, plain = _pop_nproc(argv[1:])
        try:
            checked_config(plain, nproc)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
    if argv[0] in _TORCHRUN:
        return _torchrun(_TORCHRUN[argv[0]], argv[1:])
    for words, module in _MODULES.items():
        if tuple(argv[: len(words)]) == words:
            return int(importlib.import_module(module).main(argv[len(words) :]) or 0)
    print(f"megatron-earl: unknown command {' '.join(argv[:2])!r}\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
