"""The RL loop with growing contexts under one memory budget: the selector vs static layouts.

    megatron-earl bench-rl-sweep --nproc 2 --budget-mb 14
    (= torchrun --nproc_per_node 2 -m megatron_earl.bench.rl --budget-mb 14)

The CPU demo's tiny model, warm-started (SFT) on binary-search demonstrations, plays the guessing
game (``envs.guessing``) whose difficulty grows linearly from ``--start-difficulty`` to
``--max-difficulty`` over the run: more bits -> more guesses -> more turns -> longer contexts.
Three runs in the same processes, each its own ``RLLoop`` from the same seed, interleaved step by
step in a rotating order (machine noise hits all of them alike):

- ``selector``: ``selector.enabled`` for the experience and train phases, every candidate layout,
  start-up profiling (not counted in the phase times; reported apart);
- ``static <layout>``: the same machinery with one candidate for both phases whose prediction never
  refuses it, so the same measured budget is enforced the same way; an out-of-budget phase has
  nowhere to go and ends that run (a crash: the run takes no further step).

Prints per run and per context bucket (the step's longest context, rounded up to a power of two):
the median tokens/s of the experience and train phases and of both together (tokens of the step /
busy phase time, ``time_busy``: wall time minus run-queue wait, min over ranks, less the layout
switch time ``selector/<phase>/switch_s``, which is reported apart per run), steps completed,
OOMs (out-of-budget phase runs, recovered or not), layouts; then the selector's ratio to the better
static layout per bucket, and the memory model's error: every live phase run's peak predicted
*before* it ran vs measured. Lives in orchestration (it drives ``RLLoop``); the selector layer may
not import this layer. Which ranks call: every rank (under torchrun); rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_earl.config.loader import load_config
from megatron_earl.config.run import EnvConfig, RunConfig
from megatron_earl.config.vocab import Phase
from megatron_earl.orchestration.loop import RLLoop
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.decide import NoFeasibleLayout
from megatron_earl.selector.oom import PhaseOutOfMemory
from megatron_earl.selector.throughput import bucket_of
from megatron_earl.tokenizer import build_tokenizer

BENCH_PHASES = (Phase.EXPERIENCE, Phase.TRAIN)
"""Phases the sweep selects layouts for and measures."""
BASE = [
    "sft.weak_teacher_fraction=0.0",
    "eval.num_prompts=0",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "batch.max_tokens_per_micro_batch=1024",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "env.name=guessing",
    "rollout.max_turns=20",
    "rollout.max_context=1024",
    "selector.enabled=true",
    "selector.safety_margin=0.0",
    "selector.phases=[experience,train]",
    "train.old_logprobs=always",  # the sweep measures the experience phase's log-prob pass too
]


@dataclass
class Run:
    """One of the three runs: its loop and what it measured."""

    name: str
    loop: RLLoop
    ooms: int = 0
    crash: str = ""
    rows: list[dict] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    profile: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Steps completed (one metrics row each)."""
        return len(self.rows)


def build_run(name: str, config: RunConfig, args, static: ParallelLayout | None) -> Run:
    """A loop warm-started like the demo; static runs get one candidate per phase whose
    prediction never refuses it (only the measured budget applies). Every rank calls."""
    tokenizer = build_tokenizer(config.tokenizer)
    if static is not None:
        config = dataclasses.replace(
            config,
            layouts=dataclasses.replace(config.layouts, experience=str(static), train=str(static)),
        )
    loop = RLLoop(config, tokenizer)
    loop.warm_start(EnvConfig("guessing", {"difficulty": args.sft_difficulty}).spec())
    if static is not None:
        for phase in BENCH_PHASES:
            selector = loop.selection.selectors[phase]
            selector.candidates = [static]
            selector.config = dataclasses.replace(selector.config, budget_bytes=float(1 << 50))
    run = Run(name, loop)
    run.profile = loop.profile()
    return run


def difficulty_at(step: int, args) -> int:
    span = args.max_difficulty - args.start_difficulty
    return args.start_difficulty + round(span * step / max(args.steps - 1, 1))


def take_step(run: Run, step: int, args) -> None:
    """One RL step of ``run`` at the step's difficulty; a crash ends the run. Every rank calls."""
    difficulty = difficulty_at(step, args)
    loop = run.loop
    loop.config = dataclasses.replace(
        loop.config, env=EnvConfig("guessing", {"difficulty": difficulty})
    )
    try:
        metrics = loop.run_step()
    except (NoFeasibleLayout, PhaseOutOfMemory) as err:
        run.ooms += 1
        cause = err.__cause__ or err  # the measured BudgetExceeded of a static layout
        run.crash = f"step {step + 1} (difficulty {difficulty}): {cause}"
        return
    for phase in BENCH_PHASES:
        run.ooms += int(metrics[f"selector/{phase}/ooms"])
        if metrics[f"selector/{phase}/ooms"]:
            run.recovered.append(
                f"step {step + 1} {phase}: {metrics[f'selector/{phase}/attempts']}"
            )
    run.rows.append(metrics)


def step_work(m: dict) -> dict[str, tuple[float, float]]:
    """(tokens, busy seconds less switch time) of one step per phase, and of both phases."""
    tokens = m["rollout/tokens"]
    seconds = {p: m[f"time_busy/{p}"] - m[f"selector/{p}/switch_s"] for p in BENCH_PHASES}
    out = {p: (tokens, seconds[p]) for p in BENCH_PHASES}
    out["both"] = (tokens, sum(seconds.values()))
    return out


def throughput(rows: list[dict], key: str) -> float:
    """Tokens / seconds summed over ``rows`` (steps) for ``key`` (a phase or "both")."""
    work = [step_work(m)[key] for m in rows]
    return sum(t for t, _ in work) / max(sum(s for _, s in work), 1e-9)


def bucket_of_step(m: dict) -> int:
    return bucket_of(int(m["context_len/max"]), smallest=64)


def bucket_table(run: Run) -> dict[int, dict]:
    """Per context bucket: tokens/s of experience, train and both (summed over the bucket's
    steps), the number of steps and the layouts used."""
    out: dict[int, list[dict]] = {}
    for m in run.rows:
        out.setdefault(bucket_of_step(m), []).append(m)
    return {
        b: {k: throughput(rows, k) for k in (*BENCH_PHASES, "both")}
        | {
            "n": len(rows),
            "layouts": ",".join(
                dict.fromkeys(f"{m['layout/experience']}/{m['layout/train']}" for m in rows)
            ),
        }
        for b, rows in sorted(out.items())
    }


def paired(selector: Run, static: Run, bucket: int) -> tuple[dict, dict] | None:
    """The selector's and ``static``'s throughput over the steps of ``bucket`` (by the
    selector's context) that both completed (a crashed static run has no later steps)."""
    steps = [
        (mine, theirs)
        for mine, theirs in zip(selector.rows, static.rows, strict=False)
        if bucket_of_step(mine) == bucket
    ]
    if not steps:
        return None
    mine = {k: throughput([m for m, _ in steps], k) for k in (*BENCH_PHASES, "both")}
    theirs = {k: throughput([t for _, t in steps], k) for k in (*BENCH_PHASES, "both")}
    return mine, theirs | {"n": len(steps)}


def report(runs: list[Run]) -> list[str]:
    """The printed table (rank 0). Pure."""
    lines = []
    tables = {r.name: bucket_table(r) for r in runs}
    buckets = sorted({b for t in tables.values() for b in t})
    head = f"{'run':<26} {'steps':>5} {'OOMs':>4}  " + "  ".join(
        f"{'ctx<=' + str(b):>24}" for b in buckets
    )
    lines.append(
        "tokens/s per context bucket (the step's longest context): experience / train / both "
        "(tokens / busy seconds over the bucket's steps), n steps"
    )
    lines.append(head)
    for run in runs:
        cells = []
        for b in buckets:
            c = tables[run.name].get(b)
            cells.append(
                f"{c[Phase.EXPERIENCE]:>7.0f}/{c[Phase.TRAIN]:>6.0f}/{c['both']:>6.0f} n{c['n']}"
                if c
                else f"{'OOM' if run.crash else '-':>24}"
            )
        lines.append(f"{run.name:<26} {run.steps:>5} {run.ooms:>4}  " + "  ".join(cells))
    for run in runs:
        switch_s = sum(m[f"selector/{p}/switch_s"] for m in run.rows for p in BENCH_PHASES)
        moved = sum(1 for m in run.rows for p in BENCH_PHASES if m[f"selector/{p}/switched"])
        lines.append(
            f"  {run.name}: {moved} layout changes, switch time {switch_s:.2f} s"
            " over the run (not in the tokens/s above)"
        )
        used = {b: c["layouts"] for b, c in tables[run.name].items()}
        lines.append(f"  {run.name} layouts (experience/train) per bucket: {used}")
        lines.extend(f"  {run.name} recovered at {r}" for r in run.recovered)
        if run.crash:
            lines.append(f"  {run.name} crashed at {run.crash}")
    selector, statics = runs[0], runs[1:]
    lines.append(
        "selector vs each static layout on the same steps per bucket, both phases (experience; "
        "train); the better static layout is the faster one on its steps:"
    )
    for b in buckets:
        pairs = {s.name: paired(selector, s, b) for s in statics}
        pairs = {k: v for k, v in pairs.items() if v is not None}
        if not pairs:
            continue
        parts = []
        for name, (mine, theirs) in pairs.items():
            r = [mine[k] / theirs[k] - 1 for k in ("both", *BENCH_PHASES)]
            parts.append(f"vs {name} (n{theirs['n']}): {r[0]:+.1%} ({r[1]:+.1%}; {r[2]:+.1%})")
        better = max(pairs, key=lambda k: pairs[k][1]["both"])
        mine, theirs = pairs[better]
        lines.append(
            f"  ctx<={b}: better static {better}: {mine['both'] / theirs['both'] - 1:+.1%}; "
            + "; ".join(parts)
        )
    lines.extend(memory_lines(runs))
    if selector.profile:
        lines.append(f"  selector {selector.profile[-1]} (not in the tokens/s above)")
    return lines


def memory_lines(runs: list[Run]) -> list[str]:
    """The memory model's error over every live phase run of every run (predicted before)."""
    rows = [(r.name, *a) for r in runs for a in r.loop.selection.accuracy]
    if not rows:
        return []
    err = [(p - m) / m for *_, p, m in rows]
    worst = max(range(len(rows)), key=lambda i: abs(err[i]))
    name, phase, layout, longest, p, m = rows[worst]
    lines = [
        f"memory model, predicted before each run vs measured, {len(rows)} phase runs "
        f"({', '.join(sorted({f'{r[1]} {r[2]}' for r in rows}))}): max |error| "
        f"{max(abs(e) for e in err):.1%}, mean {statistics.mean(abs(e) for e in err):.1%}; worst: "
        f"{name} {phase} {layout} at {longest} tokens: predicted {p / 2**20:.2f} MiB, measured "
        f"{m / 2**20:.2f} MiB"
    ]
    per = {}
    for (_, phase, layout, *_), e in zip(rows, err, strict=True):
        per.setdefault(f"{phase} {layout}", []).append(abs(e))
    lines.append(
        "  per phase/layout max |error|: "
        + ", ".join(f"{k} {max(v):.1%} (n={len(v)})" for k, v in sorted(per.items()))
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mb", type=float, default=14.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--start-difficulty", type=int, default=1)
    parser.add_argument("--max-difficulty", type=int, default=15)
    parser.add_argument("--sft-difficulty", type=int, default=8)
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--static", default="tp1cp1pp1dp2,tp2cp1pp1dp1")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--jsonl", default="", help="write every run's step metrics here")
    args = parser.parse_args(argv)
    if not 1 <= args.start_difficulty <= args.max_difficulty <= 16:
        parser.error(
            f"need 1 <= --start-difficulty ({args.start_difficulty}) <= --max-difficulty "
            f"({args.max_difficulty}) <= 16"
        )
    from megatron_earl import runtime

    runtime.initialize()
    overrides = [
        *BASE,
        f"sft.steps={args.sft_steps}",
        f"selector.budget_mb={args.budget_mb}",
        f"seed={args.seed}",
    ]
    # the demo with its selector settings at their defaults (profiling on, every run measured)
    config = load_config("configs/demo_cpu_switching.yaml", overrides)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(
            f"RL selector bench: world {dist.get_world_size()}, budget {args.budget_mb} MiB/rank "
            f"(margin 0), guessing difficulty {args.start_difficulty} -> {args.max_difficulty} "
            f"over {args.steps} steps, {config.batch.samples_per_step} samples/step, SFT warm "
            f"start {config.sft.steps} steps at difficulty {args.sft_difficulty}",
            flush=True,
        )
    specs: list[tuple[str, ParallelLayout | None]] = [("selector", None)]
    for s in filter(None, args.static.split(",")):
        name = f"static {ParallelLayout.parse(s)}"
        repeats = sum(1 for n, _ in specs if n.split(" #")[0] == name)
        specs.append((f"{name} #{repeats + 1}" if repeats else name, ParallelLayout.parse(s)))
    runs = [build_run(name, config, args, static) for name, static in specs]
    if rank0:
        for line in runs[0].profile:
            print(f"  {line}", flush=True)
    for step in range(args.steps):
        shift = step % len(runs)
        for run in runs[shift:] + runs[:shift]:
            if not run.crash:
                take_step(run, step, args)
        if rank0:
            ctx = [
                int(r.rows[-1]["context_len/max"]) if r.rows and not r.crash else 0 for r in runs
            ]
            print(f"  step {step + 1}/{args.steps} done; longest context per run {ctx}", flush=True)
    if rank0:
        print("\n".join(report(runs)), flush=True)
        if args.jsonl:
            with open(args.jsonl, "w") as f:
                for run in runs:
                    for row in run.rows:
                        f.write(json.dumps({"run": run.name, **row}) + "\n")
    # As every entry point does: a process that exits with its gloo groups alive can abort in
    # their threads' teardown ("terminate called without an active exception", seen once in CI).
    from megatron_earl.parallel.state import destroy_layouts

    destroy_layouts()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megatron_earl.compat.processes import skip_exit_gc

    skip_exit_gc()
    sys.exit(main())
