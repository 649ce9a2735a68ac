"""Context-length sweep benchmark: the selector vs the best short- and long-context static layouts
under one memory budget (the project-enforced CPU budget), on 2 local processes.

    python scripts/bench_selector.py                      # defaults: 512 -> 4096 tokens, 72 MiB
    python scripts/bench_selector.py --lengths 512,1024,2048,4096 --steps-per-length 2 --json

The real train phase (``rl_train_step``: packing, chunked log-probs, policy loss, Megatron DDP +
Adam) of a tiny model runs on synthetic samples whose longest length grows per step (the RL demo
environment's growth stands in until the demo exists). Three runs share the processes and are
interleaved step by step, so machine noise hits all three alike:

* **selector**: ``run_phase_with_recovery`` with a ``Selector`` (memory model with the CPU
  calibration; throughput table filled by start-up profiling at the two shortest lengths and
  refreshed from every step);
* **static short**: the layout with the best profiled tokens/s at the shortest length;
* **static long**: the fastest profiled layout predicted to fit the longest length.

A static run that raises an OOM has crashed (a static system cannot re-run the step elsewhere) and
runs no further step. Printed: steps completed, OOMs, tokens/s per length bucket of each run
(tokens / phase time per step: the median and the best step of the bucket; the selector's
layout-switch time is reported apart), the selector's layouts, and
the memory model's predicted vs measured peak over every run of the sweep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import Phase
from megatron_earl.testing.distributed import run_distributed

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=1024,
    make_vocab_size_divisible_by=64,
)
MiB = 1 << 20


def _batch_lengths(longest: int) -> list[int]:
    return [longest, (3 * longest) // 4]


def _body(lengths: list[int], steps_per_length: int, budget_mib: float, token_budget: int):
    """Every rank: profile, then the interleaved sweep. Returns the sweep record."""
    import torch

    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.selector.budget import MemoryBudget
    from megatron_earl.selector.calibrate import CalibrationPoint, fit
    from megatron_earl.selector.decide import (
        Selector,
        SelectorConfig,
        candidate_layouts,
        percentile,
    )
    from megatron_earl.selector.memory import MemoryModel, MemorySettings
    from megatron_earl.selector.oom import run_phase_with_recovery
    from megatron_earl.selector.profile import PhaseRunner, profile_layout, synthetic_samples
    from megatron_earl.selector.throughput import HardwareSpec, Roofline, ThroughputTable, bucket_of

    world = torch.distributed.get_world_size()
    budget = MemoryBudget(int(budget_mib * MiB))
    table = ThroughputTable(Roofline(MODEL, HardwareSpec.cpu()))
    candidates = candidate_layouts(world, MODEL)

    # start-up: profile every candidate at the two shortest lengths on a scratch model; the
    # measured peaks calibrate the memory model (calibrate.fit), OOMs mark cells infeasible
    scratch = PhaseRunner(MODEL, budget, token_budget=token_budget)
    points, ooms = [], []
    for length in sorted(set(lengths))[:2]:
        for layout in candidates:
            batch = _batch_lengths(length)
            try:
                result = profile_layout(scratch, table, Phase.TRAIN, layout, batch, steps=2)
            except torch.OutOfMemoryError:
                ooms.append((layout, length))
                continue
            points.append(
                CalibrationPoint(
                    Phase.TRAIN,
                    str(layout),
                    tuple(batch),
                    token_budget,
                    result.peak_bytes,
                    result.static_bytes,
                )
            )
    del scratch
    memory = MemoryModel(MODEL, MemorySettings.cpu())
    memory = MemoryModel(MODEL, fit(memory, points))
    config = SelectorConfig(budget_bytes=budget.limit_bytes, token_budget=token_budget)
    selector = Selector(MODEL, world, config, memory, table, candidates)
    for layout, length in ooms:
        selector.mark_infeasible(Phase.TRAIN, layout, length)
    shortest, longest = min(lengths), max(lengths)
    short = max(selector.candidates, key=lambda c: table.predict(Phase.TRAIN, c, shortest)[0])
    fitting = [
        c
        for c in selector.candidates
        if selector.predicted_peak(Phase.TRAIN, c, _batch_lengths(longest))
        * (1 + config.safety_margin)
        <= config.budget_bytes
    ]
    if not fitting:
        raise RuntimeError(f"no layout fits {longest} tokens in {budget_mib} MiB")
    long = max(fitting, key=lambda c: table.predict(Phase.TRAIN, c, longest)[0])

    runs = {
        "selector": PhaseRunner(MODEL, budget, token_budget=token_budget, seed=7),
        f"static short ({short})": PhaseRunner(MODEL, budget, token_budget=token_budget, seed=7),
        f"static long ({long})": PhaseRunner(MODEL, budget, token_budget=token_budget, seed=7),
    }
    static_layout = {name: lay for name, lay in zip(list(runs)[1:], (short, long), strict=True)}
    record = {name: {"steps": 0, "ooms": 0, "crashed": False, "buckets": {}} for name in runs}
    record["selector"].update(layouts=[], recoveries=0)
    accuracy = []
    schedule = [n for n in lengths for _ in range(steps_per_length)]
    for step, longest_now in enumerate(schedule):
        batch = _batch_lengths(longest_now)
        samples = synthetic_samples(batch, MODEL.vocab_size, seed=100 + step)
        bucket = bucket_of(percentile(batch, 0.95))
        names = list(runs)
        for name in names[step % 3 :] + names[: step % 3]:  # rotate the order: no bias
            runner, rec = runs[name], record[name]
            if rec["crashed"]:
                continue
            try:
                if name == "selector":
                    result, report = run_phase_with_recovery(
                        lambda data, layout, r=runner: r.run(Phase.TRAIN, data),
                        samples,
                        selector=selector,
                        phase=Phase.TRAIN,
                        lengths=batch,
                        switch=runner.switch,
                        step=step,
                    )
                    rec["ooms"] += report.num_ooms
                    rec["layouts"].append((longest_now, str(report.layout), report.decision.reason))
                    table.record(
                        Phase.TRAIN, report.layout, max(batch), result.tokens, result.seconds
                    )
                else:
                    runner.switch(static_layout[name])
                    result = runner.run(Phase.TRAIN, samples)
            except torch.OutOfMemoryError as err:
                rec["ooms"] += 1
                rec["crashed"] = f"step {step} ({longest_now} tokens): {err}"
                continue
            rec["steps"] += 1
            rec["buckets"].setdefault(bucket, []).append(result.tokens_per_s)
            layout = ParallelLayout.parse(result.layout)
            predicted = selector.predicted_peak(Phase.TRAIN, layout, batch)
            accuracy.append((name, result.layout, longest_now, predicted, result.peak_bytes))
    record["selector"]["switch_seconds"] = runs["selector"].switch_seconds
    return {
        "record": record,
        "accuracy": accuracy,
        "num_steps": len(schedule),
        "calibration": {
            "activation_scale": memory.settings.activation_scale[Phase.TRAIN],
            "fixed_bytes": memory.settings.fixed_bytes[Phase.TRAIN],
            "points": len(points),
        },
    }


def format_report(out: dict, budget_mib: float) -> str:
    record, accuracy = out["record"], out["accuracy"]
    buckets = sorted({int(b) for r in record.values() for b in r["buckets"]})
    cal = out["calibration"]
    lines = [
        f"selector sweep: {out['num_steps']} train steps, world 2, budget {budget_mib:g} MiB/rank",
        f"memory model calibrated on {cal['points']} start-up profiling runs: train activation "
        f"scale {cal['activation_scale']:.3f}, fixed {cal['fixed_bytes'] / MiB:+.2f} MiB",
        f"{'run':<28} {'steps':>5} {'OOMs':>4}  "
        + " ".join(f"{f'{b}: med/best':>15}" for b in buckets),
    ]
    for name, r in record.items():
        cells = []
        for b in buckets:
            cell = r["buckets"].get(b)
            text = f"{statistics.median(cell):.0f}/{max(cell):.0f}" if cell else "OOM/-"
            cells.append(f"{text:>15}")
        lines.append(f"{name:<28} {r['steps']:>5} {r['ooms']:>4}  " + " ".join(cells))
    sel = record["selector"]
    groups: dict[tuple[int, str], list[str]] = {}
    for n, lay, why in sel["layouts"]:
        reasons = groups.setdefault((n, lay), [])
        if why not in reasons:
            reasons.append(why)
    lines.append(
        "selector layouts: "
        + ", ".join(f"{n}: {lay} ({', '.join(why)})" for (n, lay), why in groups.items())
        + f"; switch time {sel['switch_seconds']:.2f} s (not in tok/s)"
    )
    for name, r in record.items():
        if r["crashed"]:
            lines.append(f"{name} crashed at {r['crashed']}")
    errors = [(p - m) / m for _, _, _, p, m in accuracy]
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    name, layout, length, p, m = accuracy[worst]
    lines.append(
        f"memory model: predicted vs measured peak over {len(errors)} runs "
        f"({len({a[1] for a in accuracy})} layouts): max |error| "
        f"{max(abs(e) for e in errors):.1%}, mean {sum(map(abs, errors)) / len(errors):.1%}; "
        f"worst: {layout} at {length} tokens ({name}): predicted {p / MiB:.1f} MiB, measured "
        f"{m / MiB:.1f} MiB"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="selector context-length sweep (2 processes)")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="longest length per stage")
    parser.add_argument("--steps-per-length", type=int, default=6)
    parser.add_argument("--budget-mib", type=float, default=72.0, help="memory budget per rank")
    parser.add_argument("--token-budget", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = run_distributed(
        _body,
        2,
        args=(lengths, args.steps_per_length, args.budget_mib, args.token_budget),
        timeout_s=1200,
    )[0]
    print(json.dumps(out, indent=1) if args.json else format_report(out, args.budget_mib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
