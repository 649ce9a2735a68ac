"""``megatron-earl plot RUN_DIR``: PNG plots of a run's ``metrics.jsonl``.

    python -m megatron_earl.orchestration.plot runs/demo_cpu          # -> runs/demo_cpu/plots/*.png

Figures (each drawn from the keys present; one whose keys are all absent is skipped):

- ``reward.png``   reward/mean (+- reward/std) and success_rate (eval/success_rate as markers)
- ``lengths.png``  response_len/mean, context_len/mean and /max per step; context_len_per_turn/<i>
- ``time.png``     time/<phase> stacked per step, time/step as a line
- ``layouts.png``  layout/<phase> over steps, one row per phase (the layout strings on the y axis)

Needs matplotlib (``pip install 'megatron-earl[plot]'``); draws off-screen (Agg backend).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_earl.orchestration.metrics import METRICS_FILE, read_metrics

Records = list[dict[str, Any]]


def series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a numeric key, over the records that have it."""
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            steps.append(r["step"])
            values.append(float(value))
    return steps, values


def keys_with_prefix(records: Records, prefix: str) -> list[str]:
    """Keys starting with ``prefix``, in first-seen order (numeric suffixes sorted numerically)."""
    found = dict.fromkeys(k for r in records for k in r if k.startswith(prefix))
    suffix = [k[len(prefix) :] for k in found]
    if all(s.isdigit() for s in suffix):
        return [prefix + s for s in sorted(suffix, key=int)]
    return list(found)


def _legend_and_grid(*axes) -> None:
    for ax in axes:
        if ax.lines:
            ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)


def plot_reward(records: Records, ax_reward, ax_success) -> bool:
    steps, mean = series(records, "reward/mean")
    if steps:
        ax_reward.plot(steps, mean, label="reward/mean", color="tab:blue")
        std_steps, std = series(records, "reward/std")
        if std_steps == steps:
            low = [m - s for m, s in zip(mean, std)]
            high = [m + s for m, s in zip(mean, std)]
            ax_reward.fill_between(steps, low, high, alpha=0.2, color="tab:blue", label="+- std")
    ax_reward.set(title="reward", xlabel="step")
    drawn = bool(steps)
    for key, style in (("success_rate", "-"), ("eval/success_rate", "o--")):
        s, v = series(records, key)
        if s:
            ax_success.plot(s, v, style, label=key)
            drawn = True
    ax_success.set(title="success rate", xlabel="step", ylim=(-0.02, 1.02))
    _legend_and_grid(ax_reward, ax_success)
    return drawn


def plot_lengths(records: Records, ax_steps, ax_turns) -> bool:
    drawn = False
    for key in ("response_len/mean", "context_len/mean", "context_len/max"):
        s, v = series(records, key)
        if s:
            ax_steps.plot(s, v, label=key)
            drawn = True
    ax_steps.set(title="lengths per step (tokens)", xlabel="step")
    for key in keys_with_prefix(records, "context_len_per_turn/"):
        s, v = series(records, key)
        if s:
            ax_turns.plot(s, v, label=f"turn {key.rsplit('/', 1)[-1]}")
            drawn = True
    ax_turns.set(title="context length at each turn (tokens)", xlabel="step")
    _legend_and_grid(ax_steps, ax_turns)
    return drawn


def plot_time(records: Records, ax) -> bool:
    phases = [k for k in keys_with_prefix(records, "time/") if k != "time/step"]
    steps = [r["step"] for r in records]
    if phases:
        stacks = [[float(r.get(k) or 0.0) for r in records] for k in phases]
        ax.stackplot(steps, stacks, labels=[k.split("/", 1)[1] for k in phases], alpha=0.8)
    s, v = series(records, "time/step")
    if s:
        ax.plot(s, v, color="black", linewidth=1, label="step (wall)")
    ax.set(title="time per phase (s)", xlabel="step", ylabel="seconds")
    if phases or s:
        ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    return bool(phases or s)


def plot_layouts(records: Records, axes, phases: list[str]) -> None:
    for ax, key in zip(axes, phases):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), str)]
        labels = list(dict.fromkeys(v for _, v in points))
        ax.step(
            [s for s, _ in points], [labels.index(v) for _, v in points], where="post", marker="."
        )
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(-0.5, len(labels) - 0.5)
        ax.set_ylabel(key.split("/", 1)[1])
        ax.grid(alpha=0.3)
    axes[0].set_title("layout per phase")
    axes[-1].set_xlabel("step")


def plot_run(records: Records, out_dir: str | Path) -> list[Path]:
    """Write the figures that have data into ``out_dir``; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name: str, drawn: bool) -> None:
        if drawn:
            fig.tight_layout()
            fig.savefig(out / name, dpi=100)
            written.append(out / name)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    save(fig, "reward.png", plot_reward(records, *axes))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    save(fig, "lengths.png", plot_lengths(records, *axes))
    fig, ax = plt.subplots(figsize=(8, 4))
    save(fig, "time.png", plot_time(records, ax))
    phases = keys_with_prefix(records, "layout/")
    if phases:
        fig, axes = plt.subplots(len(phases), 1, figsize=(8, 1.6 * len(phases) + 1), sharex=True)
        plot_layouts(records, list(axes) if len(phases) > 1 else [axes], phases)
        save(fig, "layouts.png", True)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``megatron-earl plot RUN_DIR [--out DIR]``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="megatron-earl plot", description="draw PNG plots of a run's metrics.jsonl"
    )
    parser.add_argument("run_dir", type=Path, help="run directory (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (RUN_DIR/plots)")
    args = parser.parse_args(argv)
    path = args.run_dir / METRICS_FILE
    if not path.is_file():
        print(f"megatron-earl plot: no {METRICS_FILE} in {args.run_dir}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "megatron-earl plot needs matplotlib: pip install 'megatron-earl[plot]'",
            file=sys.stderr,
        )
        return 2
    records = read_metrics(path)
    if not records:
        print(f"megatron-earl plot: {path} has no records", file=sys.stderr)
        return 2
    written = plot_run(records, args.out or args.run_dir / "plots")
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
