"""Memory-model calibration on CPU: predicted vs measured peak of the real train / experience
phases (``selector.profile.PhaseRunner``) in dp2, tp2, cp2, pp2 at growing lengths, with the
default constants (``MemorySettings.cpu()``), after a per-phase re-fit, and after a per-(phase,
layout) re-fit (what the RL loop does after start-up profiling).

    python scripts/bench_calibration.py [--phase train] [--lengths 512,1024,2048,4096]

Model: 2 layers, hidden 64, ffn 256, 4 heads, 2 KV groups, vocab 1024, fp32; 2 gloo processes;
batches of 2 sequences of the given length; token budget 256 per rank. Prints one table per fit.
"""

from __future__ import annotations

import argparse
import sys

from megatron_earl.bench.selector import MODEL  # the selector sweep's tiny model
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector import calibrate
from megatron_earl.selector.memory import MemoryModel, MemorySettings
from megatron_earl.testing.distributed import run_distributed


def _measure(runs, phase):
    from megatron_earl.selector.profile import PhaseRunner

    return calibrate.measure(PhaseRunner(MODEL, token_budget=256), runs, phase)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase", default="train,experience")
    parser.add_argument("--layouts", default="dp2,tp2,cp2,pp2")
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    layouts = [ParallelLayout.parse(name) for name in args.layouts.split(",")]
    runs = [(layout, [n, n]) for layout in layouts for n in lengths]
    for phase in args.phase.split(","):
        points = run_distributed(_measure, 2, args=(runs, phase), timeout_s=900)[0]
        default = MemoryModel(MODEL, MemorySettings.cpu())
        fitted = calibrate.fit(default, points)
        per_layout = calibrate.fit(default, points, per_layout=True)
        for name, settings in (
            ("default constants", default.settings),
            (
                f"per-phase re-fit (scale {fitted.activation_scale[phase]:.3f}, fixed "
                f"{fitted.fixed_bytes[phase] / 2**20:+.2f} MiB)",
                fitted,
            ),
            ("per-(phase, layout) re-fit", per_layout),
        ):
            print(f"\n{phase}: {name}")
            print(calibrate.format_errors(calibrate.errors(MemoryModel(MODEL, settings), points)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
