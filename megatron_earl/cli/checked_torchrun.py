"""torchrun that validates the run before it starts a worker: ``megatron-earl train`` runs

    python -m megatron_earl.cli.checked_torchrun --standalone --nproc_per_node=N \
        -m megatron_earl.cli.train --config FILE key=value ...

instead of ``python -m torch.distributed.run ...``. Before torchrun starts the workers, this
process validates the run for the N ranks (``cli.train.checked_config``: every start-up check,
the same ones every rank repeats) and, on a node with a GPU, models every phase's memory on it
(``selector.footprint``, what ``megatron-earl plan`` prints); a config that cannot run or does
not fit is printed as ``config error: ...`` and the command exits with code 2, no worker started.
The GPU is read with ``nvidia-smi``: a CUDA context in this process would hold memory on GPU 0
for the whole run. With ``rollout.engine: sglang`` the engines are checked here too
(``rollout.sglang.startup``: they answer, and serve what the run expects), so a dead or mismatched
engine also stops the run before any worker starts.

Why here and not in ``megatron-earl train`` itself: the checks read the machine (CUDA, Transformer
Engine, the selector's memory model) through ``torch``, which torchrun imports anyway; the
launcher then never imports ``torch`` (one import of it fewer per run, about a second).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

from megatron_earl.cli.train import checked_config
from megatron_earl.config.run import ConfigError, RunConfig
from megatron_earl.config.vocab import EngineKind
from megatron_earl.rollout.engine import EngineError
from megatron_earl.rollout.sglang.startup import engines_at_start
from megatron_earl.selector.footprint import footprint, misfit
from megatron_earl.selector.memory import GiB

USAGE = (
    "usage: python -m megatron_earl.cli.checked_torchrun [torchrun options] "
    "--nproc_per_node=N -m MODULE [module args]"
)


def split_torchrun_argv(argv: list[str]) -> tuple[int, list[str]]:
    """(the number of ranks, the arguments of the module torchrun starts) of a torchrun command
    line whose options are ``--standalone --nproc_per_node=N -m MODULE ARGS`` (the form
    ``cli.main`` writes). Raises ``ValueError`` naming a missing ``--nproc_per_node`` or ``-m``."""
    if "-m" not in argv:
        raise ValueError(f"no -m MODULE in {argv!r}; {USAGE}")
    i = argv.index("-m")
    options = argv[:i]
    values = [a.split("=", 1)[1] for a in options if a.startswith("--nproc_per_node=")]
    if len(values) != 1 or not values[0].isdigit() or int(values[0]) < 1:
        raise ValueError(f"one --nproc_per_node=N with N >= 1 expected in {options!r}; {USAGE}")
    return int(values[0]), argv[i + 2 :]


def local_gpu() -> tuple[str, float] | None:
    """(name, bytes) of this node's first GPU as ``nvidia-smi`` reports it; None without
    ``nvidia-smi`` or a GPU (then the memory is not modelled here; every rank's engine still sizes
    its KV cache from its device)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        name, mib = out.splitlines()[0].rsplit(",", 1)
        return name.strip(), float(mib) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def memory_problem(config: RunConfig, gpu: tuple[str, float] | None) -> str | None:
    """Why ``config`` does not fit ``gpu`` (name, bytes): every phase's modelled peak, the
    embedded engine's KV cache (``selector.footprint.misfit``); None when it fits or there is no
    GPU. Pure."""
    if gpu is None:
        return None
    return misfit(footprint(config, gpu[1]), f"{gpu[0]} ({gpu[1] / GiB:.1f} GiB)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc, module_argv = split_torchrun_argv(argv)
    try:
        config = checked_config(module_argv, nproc)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    problem = memory_problem(config, local_gpu())
    if problem is not None:
        print(f"config error: {problem}", file=sys.stderr)
        return 2
    if config.rollout.engine == EngineKind.SGLANG:
        try:
            asyncio.run(engines_at_start(config)).raise_problems()
        except EngineError as err:
            print(f"engine error: {err}", file=sys.stderr)
            return 2
    from torch.distributed.run import main as torchrun

    torchrun(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
