"""Replay a paced run (sync or async) of the `longtail` environment in the pipeline simulator
and print the simulator's error (docs/async.md, "Checking the simulator").

    PACE_DECODE_MS=40 ENGINES=1 ROUTER=0 OUT=/tmp/calib bash scripts/sglang_local.sh CONFIG \
        steps=10 [rollout.mode=async rollout.max_staleness=1] ...   # CONFIG: env longtail
    python scripts/sim_replay.py --run-dir /tmp/calib/runs/NAME --pace-ms 40 \
        --prefill-ms 11.4 --env '{"scale": 2, "shape": 1.0, "max_turns": 8, "digits": 6}' \
        --env-step-s 0,0.05,0.08 [--max-staleness 1]

Inputs taken from the run: the task seeds (group g is task seed g, in the order the groups
start, in both modes), whose turn counts the environment fixes (a right answer is digits + 1
tokens; checked against the run's ``rollout/turns_mean`` and ``response_len/mean``), the
trainer's time and the mean weight push. The trainer's time: sync, the busy experience + train
time (``time_busy``: the trainer runs alone; its wall ``time/train`` also holds the wait for the
other ranks' rollouts); async, the wall ``time/step - time/rollout`` (the trainer shares the
cores with the background generation, which slows it down on this machine). Not measured by the
run and scanned here: ``env_step_s``, the per-turn overhead between two model turns (HTTP round
trip, the agent loop, the environment step, CPU contention).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

from megatron_earl.bench.pipeline_sim import LengthDist, SimConfig, simulate
from megatron_earl.envs import LongTailEnv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--env", required=True, help="the longtail env's kwargs (JSON)")
    p.add_argument("--pace-ms", type=float, required=True)
    p.add_argument("--prefill-ms", type=float, required=True)
    p.add_argument("--env-step-s", default="0", help="comma-separated values to try")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--slots", type=int, default=64, help="ENGINE_BATCH of sglang_local.sh")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-staleness", type=int, default=None, help="async run: its k")
    args = p.parse_args()
    asynchronous = args.max_staleness is not None
    rows = [json.loads(line) for line in open(f"{args.run_dir}/metrics.jsonl")]
    env = LongTailEnv(**json.loads(args.env))
    per_turn = env.digits + 1
    n, g = args.prompts_per_step, args.samples_per_prompt
    for step, row in enumerate(rows):
        if abs(row["rollout/turns_mean"] * per_turn - row["response_len/mean"]) > 1e-9:
            raise SystemExit(f"step {step + 1}: answers are not {per_turn} tokens (policy?)")
        turns = [len(env.task(seed)) for seed in range(step * n, (step + 1) * n)]
        if not asynchronous and abs(statistics.mean(turns) - row["rollout/turns_mean"]) > 1e-9:
            raise SystemExit(f"step {step + 1}: the run's turns are not the tasks' (seeds?)")
    lengths = [
        len(env.task(seed)) * per_turn for seed in range(4 * n * len(rows)) for _ in range(g)
    ]
    if asynchronous:
        train = statistics.mean(r["time/step"] - r["time/rollout"] for r in rows)
    else:
        train = statistics.mean(r["time_busy/train"] + r["time_busy/experience"] for r in rows)
    push = statistics.mean(r["sync/weight_push_s"] for r in rows if "sync/weight_push_s" in r)
    measured = [r["time/step"] for r in rows]
    print(f"{len(rows)} steps; trainer {train:.3f} s/step, push {push:.3f} s (run means)")
    for env_step_s in (float(x) for x in args.env_step_s.split(",")):
        config = SimConfig(
            num_engines=args.engines,
            slots_per_engine=args.slots,
            decode_s_per_token=args.pace_ms / 1e3,
            prefill_s=args.prefill_ms / 1e3,
            lengths=LengthDist.sequence(lengths),
            tokens_per_turn=per_turn,
            env_step_s=env_step_s,
            group_size=g,
            prompts_per_step=n,
            train_s_fixed=train,
            push_s=push,
            num_steps=len(rows),
            **({"mode": "async", "max_staleness": args.max_staleness} if asynchronous else {}),
        )
        result = simulate(config)
        ends = [0.0, *result.step_end_s]
        sim = [b - a for a, b in itertools.pairwise(ends)]
        errors = [abs(s - m) / m for s, m in zip(sim, measured)]
        total = (sum(sim) - sum(measured)) / sum(measured)
        print(
            f"env_step_s={env_step_s:g}: simulated {sum(sim):.2f} s vs measured "
            f"{sum(measured):.2f} s ({total:+.1%}); mean |per-step error| "
            f"{statistics.mean(errors):.1%}, max {max(errors):.1%}; discarded groups "
            f"{result.discarded_trajectories // g}, trajectory lags "
            f"{dict(sorted(result.staleness_trajectories.items()))}"
        )
    if asynchronous:
        lags = {k[len("rollout/staleness_traj_lag") :]: 0 for k in rows[-1] if "traj_lag" in k}
        for row in rows:
            for lag in lags:
                lags[lag] += int(row[f"rollout/staleness_traj_lag{lag}"])
        discarded = int(rows[-1]["rollout/async_discarded_groups"])
        print(f"measured: discarded groups {discarded}, trajectory lags {lags}")


if __name__ == "__main__":
    main()
