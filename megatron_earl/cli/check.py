"""Pre-flight check of a run config, for launch scripts: load, apply overrides, validate against
the world size (every check ``megatron-earl train`` makes: ``cli.train.check_run``), model the
memory of every phase on the GPU (``selector.footprint``, what ``megatron-earl plan CONFIG``
prints), print one line (or the errors) and exit, before any process is started.

    python -m megatron_earl.cli.check --world-size 16 --config configs/qwen2.5-7b_grpo.yaml \
        [--gpu h100-80gb | --gpu-memory 80] train.lr=1e-6 rollout.max_turns=8

The GPU: ``--gpu`` (a preset of ``selector.footprint.GPU_PRESETS``) or ``--gpu-memory`` GiB, else
the one the config file names (its ``# gpu: NAME`` line), else this machine's CUDA device; with
none of them the memory is not modelled (said on the line). A config whose peak on some phase
exceeds the GPU, or whose embedded engine's KV cache holds no row, is refused naming the term
and the fix. With the selector on, its own budget checks run too (``selector_problems``).

Exit status 0 when the run can start, 2 with the error on stderr otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_earl.cli.train import check_run
from megatron_earl.config.loader import load_config
from megatron_earl.config.run import ConfigError
from megatron_earl.config.vocab import Phase
from megatron_earl.parallel.layout import phase_layout
from megatron_earl.selector.footprint import (
    GPU_PRESETS,
    declared_gpu,
    footprint,
    gpu_preset,
    misfit,
)
from megatron_earl.selector.memory import GiB


def target_gpu(args: argparse.Namespace) -> tuple[str, float] | None:
    """(name, bytes) of the GPU the memory is modelled on (module docstring), or None."""
    if args.gpu_memory is not None:
        return f"{args.gpu_memory:g} GiB", args.gpu_memory * GiB
    name = args.gpu or (declared_gpu(args.config) if args.config else None)
    if name is not None:
        preset = gpu_preset(name)
        return preset.name, preset.bytes
    import torch  # the launchers' machine may have no GPU: only then is torch asked

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.name, float(props.total_memory)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_earl.cli.check")
    parser.add_argument("--world-size", type=int, required=True, help="ranks the job will have")
    parser.add_argument("--config", default=None, help="YAML run config")
    parser.add_argument("--gpu", default=None, help=f"GPU preset: {', '.join(GPU_PRESETS)}")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    args = parser.parse_args(argv)
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        parser.error(f"--gpu-memory ({args.gpu_memory:g}) must be > 0 GiB")
    try:
        gpu = target_gpu(args)
    except ValueError as err:  # an unknown preset, on the command line or in the config
        parser.error(str(err))
    try:
        cfg = load_config(args.config, args.overrides)
        check_run(cfg, args.world_size)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    memory = "memory not modelled (no --gpu, no '# gpu:' line in the config, no CUDA device)"
    if gpu is not None:
        fp = footprint(cfg, gpu[1])
        problem = misfit(fp, gpu[0])
        if problem is not None:
            print(f"config error: {problem}", file=sys.stderr)
            return 2
        tight = max(fp.phases, key=lambda p: p.total)
        memory = (
            f"memory on {gpu[0]}: peak {tight.total / GiB:.1f} GiB ({tight.phase}), headroom "
            f"{fp.headroom / GiB:.1f} GiB per GPU"
        )
    layouts = " ".join(f"{p}={phase_layout(cfg.layouts, p)}" for p in Phase)
    print(
        f"config ok: {cfg.name} on {args.world_size} ranks: {layouts}; {memory}; "
        f"run dir {cfg.run_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
