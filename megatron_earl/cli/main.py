"""The ``megatron-earl`` command: subcommands for the project's entry points.

megatron-earl smoke --nproc 2 --layout tp2      # multi-process CPU training smoke run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _torchrun(module: str, nproc: int, rest: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *rest,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-earl")
    sub = parser.add_subparsers(dest="command", required=True)
    smoke = sub.add_parser("smoke", help="multi-process CPU training smoke run (torchrun)")
    smoke.add_argument("--nproc", type=int, default=2, help="processes to start")
    args, rest = parser.parse_known_args(argv)
    if args.command == "smoke":
        return _torchrun("megatron_earl.cli.smoke", args.nproc, rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
