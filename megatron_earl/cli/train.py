"""The RL trainer entry point; every rank runs it (torchrun / srun + torchrun):

    torchrun --nproc_per_node 2 -m megatron_earl.cli.train --config configs/demo_cpu.yaml \
        steps=40 train.lr=3e-4
    torchrun ... -m megatron_earl.cli.train "${MEGATRON_LM_RECIPE_ARGS[@]}" --earl-env arithmetic

or ``megatron-earl train --nproc 2 --config ...`` (starts torchrun itself). The config is loaded,
its overrides applied and the whole run validated against the world size *before* any process
group exists; then: resume (newest checkpoint of the run) or warm start (SFT), a held-out
evaluation, the RL steps (metrics, progress, checkpoints), a final evaluation.

Guards (docs/reliability.md): every process group gets ``runtime.collective_timeout_s``; a rank
that fails prints the activity and step it was in; the hang watchdog
(``runtime.watchdog_timeout_s``, ``orchestration.watchdog``) names a stopped or frozen rank and
stops the job; with ``checkpoint.on_signal`` SIGTERM / SIGINT end the run after the current step
and a checkpoint (``orchestration.signals``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_earl.config.run import RunConfig

ERROR_FILE_ENV = "MEGATRON_EARL_ERROR_FILE"
"""Where rank 0 writes a run-ending user error (e.g. the selector's, ``_report``), so that
``megatron-earl train`` (``cli.main``, which sets it) repeats it as its last line, after
torchrun's failure report."""


def resolve_config(argv: list[str], world_size: int) -> RunConfig:
    """The run config of a command line, in either of two styles:

    - ``--config FILE key=value ...`` (YAML + dotted overrides);
    - Megatron-LM flags (``--num-layers 28 --tensor-model-parallel-size 4 ...``) with this
      plugin's ``--earl-*`` flags: an existing Megatron recipe's bash arguments, unchanged
      (``config.megatron_args``; docs/megatron_args.md).
    """
    from megatron_earl.config.loader import load_config

    if any(a.startswith("--") and a.split("=")[0] != "--config" for a in argv):
        from megatron_earl.config.megatron_args import build_parser, config_from_megatron_args

        return config_from_megatron_args(build_parser().parse_args(argv), world_size=world_size)
    parser = argparse.ArgumentParser(
        prog="megatron_earl.cli.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", default=None, help="YAML run config (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")
    args = parser.parse_args(argv)
    return load_config(args.config, args.overrides)


def checked_config(argv: list[str], world_size: int) -> RunConfig:
    """``resolve_config`` validated for ``world_size`` ranks (``check_run``): raises one
    ``ConfigError``. Pure; run before any process group, by ``megatron-earl train`` and again by
    every rank here."""
    config = resolve_config(argv, world_size)
    check_run(config, world_size)
    return config


def check_run(config: RunConfig, world_size: int) -> None:
    """Every start-up check of ``config`` on ``world_size`` ranks: ``validate_run``, then what the
    rollout engine kind needs (``rollout_backend_problems``), the selector's budget
    (``selector_problems``) and what the machine must provide (``machine_problems``: Transformer
    Engine, CUDA). Raises one ``ConfigError``. No process group (also the launch scripts'
    pre-flight, ``cli.check``)."""
    from megatron_earl.config.run import ConfigError
    from megatron_earl.orchestration.engines import rollout_backend_problems
    from megatron_earl.orchestration.selection import selector_problems
    from megatron_earl.orchestration.validate import machine_problems, validate_run

    validate_run(config, world_size)
    problems = (
        rollout_backend_problems(config)
        + selector_problems(config, world_size)
        + machine_problems(config)
    )
    if problems:
        raise ConfigError("\n  ".join(problems))


WATCHDOG_EXIT = 4
"""Exit code of a rank whose watchdog found a stuck peer."""


def main(argv: list[str] | None = None) -> int:
    from megatron_earl.config.loader import save_config

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = checked_config(list(sys.argv[1:] if argv is None else argv), world_size)

    import torch.distributed as dist

    from megatron_earl import runtime
    from megatron_earl.config.vocab import Phase
    from megatron_earl.orchestration.loop import EmptyStepsError
    from megatron_earl.orchestration.run import train
    from megatron_earl.orchestration.signals import StopSignal
    from megatron_earl.orchestration.watchdog import Heartbeat
    from megatron_earl.selector.decide import NoFeasibleLayout
    from megatron_earl.selector.oom import PhaseOutOfMemory

    # What is loaded so far (modules, the config) lives until exit: out of the collector, so
    # that its full collections (destroy_layouts' at the end: ~0.4 s less) scan only the run's.
    gc.freeze()
    runtime.initialize(timeout_s=config.runtime.collective_timeout_s)
    stop = StopSignal.install() if config.checkpoint.on_signal else None
    if dist.get_rank() == 0:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, config.run_dir / "config.yaml")
    heartbeat = Heartbeat()
    watchdog = _start_watchdog(config, heartbeat)
    start = time.time()
    try:
        summary = train(config, heartbeat, stop)
    except (NoFeasibleLayout, PhaseOutOfMemory, EmptyStepsError) as err:
        # Every rank raises the same error (decisions are deterministic; the empty-step count is
        # all-reduced): one message, no trace.
        kind = Phase.ROLLOUT if isinstance(err, EmptyStepsError) else "selector"
        if dist.get_rank() == 0:
            _report(f"{kind} error: {err}")
        return 3
    except Exception as err:
        # e.g. a collective that timed out (runtime.collective_timeout_s): say where it was
        _report(
            f"rank {dist.get_rank()} failed during {heartbeat.describe()}: "
            f"{type(err).__name__}: {err}"
        )
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
    if dist.get_rank() == 0:
        summary["wall_s"] = round(time.time() - start, 1)
        if "before" in summary and "after" in summary:
            before = summary["before"]["eval/success_rate"]
            after = summary["after"]["eval/success_rate"]
            print(
                f"held-out success rate: before RL {before:.3f} -> after RL {after:.3f} "
                f"({after - before:+.3f}) in {summary['wall_s']:.0f} s",
                flush=True,
            )
        print(json.dumps(summary), flush=True)
    from megatron_earl.parallel.state import destroy_layouts

    destroy_layouts()
    dist.destroy_process_group()
    return 0


def _report(message: str) -> None:
    """Print a run-ending error on stderr and leave it for ``megatron-earl train`` (which repeats
    it as its last line, after torchrun's failure report)."""
    print(message, file=sys.stderr, flush=True)
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(message)
        os.replace(tmp, path)


def _start_watchdog(config: RunConfig, heartbeat):
    """This rank's hang watchdog (``orchestration.watchdog``; None when
    ``runtime.watchdog_timeout_s`` is null); its board is the job's rendezvous store, so the run
    directory may be node-local. Every rank calls (agrees on the launch token)."""
    import torch.distributed as dist

    from megatron_earl.orchestration.watchdog import (
        StoreBoard,
        Watchdog,
        launch_token,
        rendezvous_store,
    )

    timeout_s = config.runtime.watchdog_timeout_s
    if timeout_s is None:
        return None
    store = rendezvous_store(timeout_s=min(max(timeout_s / 5, 1.0), 10.0))
    return Watchdog(
        StoreBoard(store, launch=launch_token()),
        dist.get_rank(),
        dist.get_world_size(),
        timeout_s=timeout_s,
        heartbeat=heartbeat,
        on_stuck=_stop_job,
    ).start()


def _stop_job(message: str, peer) -> None:
    """The watchdog found a stuck rank: report it, kill it when it runs on this host (a stopped
    process can still be killed; its checkpoint writers die with it), and end this rank, so that
    torchrun stops the others. Runs on the watchdog's thread."""
    import signal
    import socket

    _report(message)
    if peer.pid is not None and peer.host == socket.gethostname():
        try:
            os.kill(peer.pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(WATCHDOG_EXIT)


if __name__ == "__main__":
    from megatron_earl.compat.processes import skip_exit_gc

    skip_exit_gc()
    sys.exit(main())
