"""Which rank of which world this process is, from the launcher's environment (pure).

    env = launch_env(os.environ)        # {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", ...}
    os.environ.update(env)              # what torch.distributed's env:// rendezvous reads

- torchrun (and any launcher that sets ``RANK`` and ``WORLD_SIZE``): taken as they are.
- ``srun python -m megatron_earl.cli.train ...`` (one task per rank, no torchrun): ``RANK`` =
  ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``;
  ``MASTER_ADDR`` must be set by the job script (every task must name the same host: e.g.
  ``export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)``),
  ``MASTER_PORT`` defaults to one derived from ``SLURM_JOB_ID`` (the same in every task).
  Without ``MASTER_ADDR`` the launch is refused (``LaunchError``) naming it: a task must never
  run as a world of one while its job has several tasks.
- Neither (a plain ``python -m ...``, or a job of one task): a world of one on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000
"""``MASTER_PORT`` of an srun launch without one: ``SLURM_PORT_BASE + SLURM_JOB_ID %
SLURM_PORT_SPAN`` (below the usual ephemeral range, 32768+)."""


class LaunchError(RuntimeError):
    """The environment does not say which rank of which world this process is."""


def launch_env(
    environ: Mapping[str, str], free_port: Callable[[], int] = lambda: 29500
) -> dict[str, str]:
    """The torch.distributed variables this process runs with (module docstring);
    ``free_port()`` picks ``MASTER_PORT`` where nothing sets it and no other process needs it."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {
            "RANK": environ["RANK"],
            "WORLD_SIZE": environ["WORLD_SIZE"],
            "LOCAL_RANK": environ.get("LOCAL_RANK", "0"),
            "MASTER_ADDR": environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": environ.get("MASTER_PORT") or str(free_port()),
        }
    tasks = _int(environ, "SLURM_NTASKS", 1)
    if tasks > 1:
        missing = [name for name in ("SLURM_PROCID", "MASTER_ADDR") if name not in environ]
        if missing:
            raise LaunchError(
                f"started by srun as one of {tasks} tasks (SLURM_NTASKS={tasks}) without "
                f"torchrun, but {', '.join(missing)} is not set: every task must name the same "
                "master host, e.g. export MASTER_ADDR=$(scontrol show hostnames "
                '"$SLURM_JOB_NODELIST" | head -n 1) before srun; or start one torchrun per '
                "node (scripts/torchrun_node.sh)"
            )
        rank = _int(environ, "SLURM_PROCID", 0)
        if not 0 <= rank < tasks:
            raise LaunchError(f"SLURM_PROCID={rank} is not in [0, SLURM_NTASKS={tasks})")
        job = _int(environ, "SLURM_JOB_ID", 0)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(tasks),
            "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": environ["MASTER_ADDR"],
            "MASTER_PORT": environ.get("MASTER_PORT", str(SLURM_PORT_BASE + job % SLURM_PORT_SPAN)),
        }
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": environ.get("LOCAL_RANK", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(free_port()),
    }


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None
