"""torchrun that validates the run before it starts a worker: ``megatron-earl train`` runs

    python -m megatron_earl.cli.checked_torchrun --standalone --nproc_per_node=N \
        -m megatron_earl.cli.train --config FILE key=value ...

instead of ``python -m torch.distributed.run ...``. Before torchrun starts the workers, this
process validates the run for the N ranks (``cli.train.checked_config``: every start-up check,
the same ones every rank repeats); a config that cannot run is printed as ``config error: ...``
and the command exits with code 2, no worker started.

Why here and not in ``megatron-earl train`` itself: the checks read the machine (CUDA, Transformer
Engine, the selector's memory model) through ``torch``, which torchrun imports anyway; the
launcher then never imports ``torch`` (one import of it fewer per run, about a second).
"""

from __future__ import annotations

import sys

from megatron_earl.cli.train import checked_config
from megatron_earl.config.run import ConfigError

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc, module_argv = split_torchrun_argv(argv)
    try:
        checked_config(module_argv, nproc)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from torch.distributed.run import main as torchrun

    torchrun(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
