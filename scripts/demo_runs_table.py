"""A markdown table of finished demo runs: held-out success before and after RL, the rollout/train
log-prob gap, and the weight push per step.

    python scripts/demo_runs_table.py RUNS_DIR/NAME [RUNS_DIR/NAME ...]
    python scripts/demo_runs_table.py runs/sglang_demo/*        # what scripts/demo_on_sglang.sh ran

Per run (a run directory of ``megatron-earl train``: ``metrics.jsonl`` and the ``eval_*.json`` or
the launcher's summary line in ``<run>.log`` beside it):

- before -> after: ``eval/success_rate`` of the held-out evaluations (``eval.num_prompts`` prompts
  x ``eval.samples_per_prompt`` samples, temperature ``eval.temperature``);
- gap mean / max: ``rollout/logprob_mismatch`` (the step's mean |trainer log-prob - engine
  log-prob| over trainable tokens) averaged and maximised over the steps; and the largest
  |log w| of the per-token importance weights (``train/is_weight_min``/``max``): the largest
  single-token gap of the run;
- push s/step: ``sync/weight_push_s`` (gather onto rank 0 and push, as the trainer waits for it)
  and ``sync/weight_transfer_s`` (the push alone), means over the steps that pushed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def summary(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    evals = _evals(run)
    gaps = [r["rollout/logprob_mismatch"] for r in records if "rollout/logprob_mismatch" in r]
    weights = [
        abs(math.log(w))
        for r in records
        for w in (r.get("train/is_weight_min"), r.get("train/is_weight_max"))
        if w
    ]
    push = [r["sync/weight_push_s"] for r in records if "sync/weight_push_s" in r]
    transfer = [r["sync/weight_transfer_s"] for r in records if "sync/weight_transfer_s" in r]
    return {
        "run": run.name,
        "steps": len(records),
        "before": evals.get("before"),
        "after": evals.get("after"),
        "gap_mean": statistics.fmean(gaps) if gaps else None,
        "gap_max": max(gaps) if gaps else None,
        "token_gap_max": max(weights) if weights else None,
        "push_s": statistics.fmean(push) if push else None,
        "transfer_s": statistics.fmean(transfer) if transfer else None,
        "trajectories": int(sum(r.get("rollout/trajectories", 0) for r in records)),
        "failed": int(sum(r.get("rollout/failed", 0) for r in records)),
    }


def _evals(run: Path) -> dict:
    """{"before": rate, "after": rate} from the launcher's summary line (``<run>.log`` next to the
    run directory or inside it) or the run's metrics."""
    for log in (run.parent.parent / f"{run.name}.log", run / "train.log"):
        if log.is_file():
            for line in log.read_text().splitlines():
                if line.startswith('{"before"'):
                    data = json.loads(line)
                    return {k: data[k]["eval/success_rate"] for k in ("before", "after")}
    return {}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print("| run | steps | held-out before -> after | gap mean / max (nats) | max token |log w| "
          "| push s/step (transfer) | trajectories (failed) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            print(f"{run}: no metrics.jsonl", file=sys.stderr)
            continue
        s = summary(run)
        print(
            f"| {s['run']} | {s['steps']} | {_fmt(s['before'], '.3f')} -> "
            f"{_fmt(s['after'], '.3f')} | {_fmt(s['gap_mean'], '.1e')} / "
            f"{_fmt(s['gap_max'], '.1e')} | {_fmt(s['token_gap_max'], '.1e')} | "
            f"{_fmt(s['push_s'], '.2f')} ({_fmt(s['transfer_s'], '.2f')}) | "
            f"{s['trajectories']} ({s['failed']}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
