"""The RL loop with growing contexts under one memory budget: the selector vs static layouts.

    torchrun --nproc_per_node 2 -m megatron_earl.orchestration.bench_rl --budget-mb 3.2

The CPU demo's tiny model, warm-started (SFT) on binary-search demonstrations, plays the guessing
game (``envs.guessing``) whose difficulty grows by ``--difficulty-step`` every step: more bits ->
more guesses -> more turns -> longer contexts. Three runs in the same processes, one after the
other, each from the same seed:

- ``selector``: ``selector.enabled`` with every experience candidate;
- ``static <layout>``: the same machinery with one candidate whose prediction never refuses it,
  so the same measured budget is enforced the same way; an out-of-budget experience phase has
  nowhere to go and ends that run (a crash).

Prints per run: steps completed, OOMs (out-of-budget phase runs, recovered or not), the layouts
used, and tokens/s of the rollout and experience phases (tokens of the step / phase time, median
over the run's steps). Lives in orchestration (it drives ``RLLoop``); the selector layer may not
import this layer. Which ranks call: every rank (under torchrun); rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch.distributed as dist

from megatron_earl.config.loader import load_config
from megatron_earl.config.run import EnvConfig, RunConfig
from megatron_earl.orchestration.loop import RLLoop
from megatron_earl.orchestration.sft import warm_start
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.parallel.state import use_layout
from megatron_earl.selector.decide import NoFeasibleLayout
from megatron_earl.selector.oom import PhaseOutOfMemory
from megatron_earl.tokenizer import build_tokenizer

BASE = [
    "sft.steps=40",
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
]


def run_one(config: RunConfig, args, static: ParallelLayout | None) -> dict:
    """One run of ``args.steps`` steps; returns its summary (the same on every rank)."""
    tokenizer = build_tokenizer(config.tokenizer)
    loop = RLLoop(config, tokenizer)
    use_layout(config.layout("train"))
    sft_env = EnvConfig("guessing", {"difficulty": args.sft_difficulty}).spec()
    warm_start(
        loop.policy.ddp_chunks,
        loop.policy.optimizer,
        config.sft,
        sft_env,
        tokenizer,
        max_tokens_per_micro_batch=config.batch.max_tokens_per_micro_batch,
        vocab_size=config.model.vocab_size,
    )
    loop.policy.version += config.sft.steps
    if static is not None:  # one candidate, never refused by the prediction: only measured
        selector = loop.selection.selectors["experience"]
        selector.candidates = [static]
        selector.config = dataclasses.replace(selector.config, budget_bytes=float(1 << 50))
    out = {"steps": 0, "ooms": 0, "layouts": [], "rollout": [], "experience": [], "crash": ""}
    for step in range(args.steps):
        difficulty = min(16, args.start_difficulty + step * args.difficulty_step)
        env = EnvConfig("guessing", {"difficulty": difficulty})
        loop.config = dataclasses.replace(loop.config, env=env)
        try:
            metrics = loop.run_step()
        except (NoFeasibleLayout, PhaseOutOfMemory) as err:
            out["ooms"] += 1
            cause = err.__cause__ or err  # the measured BudgetExceeded of a static layout
            out["crash"] = f"step {step + 1} (difficulty {difficulty}): {cause}"
            break
        if metrics["selector/experience/ooms"]:
            out.setdefault("recovered", []).append(
                f"step {step + 1}: {metrics['selector/experience/attempts']}"
            )
        out["steps"] += 1
        out["ooms"] += int(metrics["selector/experience/ooms"])
        out["layouts"].append(metrics["layout/experience"])
        tokens = metrics["rollout/tokens"]
        out["rollout"].append(tokens / metrics["time/rollout"])
        out["experience"].append(tokens / metrics["time/experience"])
        out.setdefault("measured_mb", []).append(metrics["selector/experience/measured_mb"])
        out.setdefault("ctx_max", []).append(int(metrics["context_len/max"]))
    use_layout(config.layout("train"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mb", type=float, default=3.2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--start-difficulty", type=int, default=1)
    parser.add_argument("--difficulty-step", type=int, default=2)
    parser.add_argument("--sft-difficulty", type=int, default=8)
    parser.add_argument("--static", default="tp1cp1pp1dp2,tp2cp1pp1dp1")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    from megatron_earl import runtime

    runtime.initialize()
    overrides = [*BASE, f"selector.budget_mb={args.budget_mb}", f"seed={args.seed}"]
    config = load_config("configs/demo_cpu.yaml", overrides)
    runs = [("selector", None)] + [
        (f"static {s}", ParallelLayout.parse(s)) for s in args.static.split(",") if s
    ]
    rank0 = dist.get_rank() == 0
    if rank0:
        print(
            f"RL selector bench: world {dist.get_world_size()}, budget {args.budget_mb} MiB/rank "
            f"(margin 0), guessing difficulty {args.start_difficulty} + {args.difficulty_step} per "
            f"step (max 16), {args.steps} steps, 16 samples/step, SFT warm start "
            f"{config.sft.steps} steps at difficulty {args.sft_difficulty}"
        )
        print(f"{'run':<26} steps OOMs  rollout tok/s  experience tok/s  layouts / peaks")
    for name, static in runs:
        out = run_one(config, args, static)
        if rank0:
            med = {k: statistics.median(out[k] or [0.0]) for k in ("rollout", "experience")}
            used = ",".join(dict.fromkeys(out["layouts"])) or "-"
            peaks = "/".join(f"{p:.2f}" for p in out.get("measured_mb", []))
            print(
                f"{name:<26} {out['steps']:>5} {out['ooms']:>4} {med['rollout']:>14.0f} "
                f"{med['experience']:>17.0f}  {used}; MiB {peaks}; ctx {out.get('ctx_max', [])}",
                flush=True,
            )
            for line in out.get("recovered", []):
                print(f"  {name} recovered at {line}", flush=True)
            if out["crash"]:
                print(f"  {name} crashed at {out['crash']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
