"""``megatron-earl bench async``: the real trainer, synchronous vs asynchronous, on PACED engines
and a long-tailed workload, and the pipeline simulator fed by the synchronous run's measurements
(its error against the measured runs).

    megatron-earl bench async [--pace-ms 30] [--steps 8] [--staleness 1,2] [--json]

Setting: ``ENGINES`` (2) ``megatron-earl serve`` processes started with ``--pace-decode-ms``
(every decode step lasts at least the pace after the real forward, as on a GPU whatever the CPU
contention: labelled PACED in the output), the trainer under ``megatron-earl train --nproc 2``
on ``configs/bench_async_longtail.yaml`` (the ``longtail`` environment: lognormal turn counts)
with ``rollout.engine=sglang``, once in ``rollout.mode=sync`` and once per staleness k in
``rollout.mode=async`` (``continue``), the same seed. Each run starts with an SFT warm start
(not timed) and pushes its own weights. Measured per run over the steady steps (the first
``--skip`` excluded): s/step, trajectories trained per second, the trainer's idle fraction
(``time/rollout`` / ``time/step``: waiting for rollouts, the push included), the engines' paced
decode steps and overruns (``/server_info``), discarded groups.

Simulator check: ``bench.pipeline_sim`` replays each run -- the pace, the engines'
measured mean prefill, the trajectories of the task seeds in the order their groups start (a
trajectory's tokens = its task's turns x the measured tokens per turn), the run's own trainer
time per token and mean push -- with one input no run measures, the per-turn overhead between two
model turns (HTTP round trip, agent loop, environment step), fitted so that the simulated sync
s/step equals the measured one. The async runs are then predictions (their scheduling: what
overlaps, what waits, what is discarded), and their error is reported.

Costs counted on both sides: each s/step is the trainer's whole step (rollout wait and push,
dispatch, experience, train, metrics); the async runs pay their producers' threads and the
generation they do for later steps (or discard) inside the same wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_earl.bench.pipeline_sim import SimConfig, simulate
from megatron_earl.config.loader import load_config
from megatron_earl.envs.longtail import LongTailEnv
from megatron_earl.rollout.sglang.client import ClientConfig, SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess
from megatron_earl.testing.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "bench_async_longtail.yaml"
KEY = "bench-async-key"


def server_infos(urls: list[str]) -> list[dict]:
    async def get() -> list[dict]:
        clients = [SGLangClient(u, ClientConfig(api_key=KEY)) for u in urls]
        try:
            return list(await asyncio.gather(*(c.get_server_info() for c in clients)))
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    return asyncio.run(get())


def pacing_between(before: list[dict], after: list[dict]) -> dict[str, float]:
    """Decode steps, overruns and prefills of the engines between two ``/server_info`` reads."""
    out = {"decode_steps": 0.0, "overruns": 0.0, "prefill_steps": 0.0, "prefill_ms_total": 0.0}
    for a, b in zip(before, after, strict=True):
        pa, pb = a["pacing"], b["pacing"]
        out["decode_steps"] += pb["decode_steps"] - pa["decode_steps"]
        out["overruns"] += pb["overruns"] - pa["overruns"]
        steps = pb["prefill_steps"] - pa["prefill_steps"]
        out["prefill_steps"] += steps
        out["prefill_ms_total"] += (
            pb["mean_prefill_ms"] * pb["prefill_steps"]
            - pa["mean_prefill_ms"] * pa["prefill_steps"]
        )
    out["mean_prefill_ms"] = out.pop("prefill_ms_total") / max(out["prefill_steps"], 1.0)
    return out


def paced_engines(args, out: Path, model_json: Path, max_context: int) -> list[ServerProcess]:
    """``args.engines`` ``megatron-earl serve`` processes (not started yet) with random weights,
    paced at ``args.pace_ms`` per decode step, a batch of ``args.engine_batch``, the API key."""
    return [
        ServerProcess(
            LaunchConfig(
                model_path="random",
                port=free_port(),
                module="megatron_earl.rollout.serve.server",
                api_key=KEY,
                extra_args=(
                    "--model-config",
                    str(model_json),
                    "--max-seq-len",
                    str(max_context),
                    "--max-batch-size",
                    str(args.engine_batch),
                    "--pace-decode-ms",
                    str(args.pace_ms),
                ),
            ),
            log_path=str(out / f"engine{i}.log"),
            env={"OMP_NUM_THREADS": "1"},
            rebind_on_conflict=True,
        )
        for i in range(args.engines)
    ]


def train_run(
    name: str, urls: list[str], out: Path, overrides: list[str], nproc: int
) -> list[dict]:
    """One training run; its metrics records."""
    cmd = [
        sys.executable,
        "-m",
        "megatron_earl.cli.main",
        "train",
        "--nproc",
        str(nproc),
        "--config",
        str(CONFIG),
        f"output_dir={out}",
        f"name={name}",
        f"rollout.engine_urls=[{','.join(urls)}]",
        "logging.progress=false",
        *overrides,
    ]
    env = {**os.environ, "SGLANG_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"bench async: run {name} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").open()]


def steady(records: list[dict], skip: int) -> dict[str, float]:
    """The steady steps' figures of one run (the first ``skip`` excluded)."""
    rs = records[skip:]
    if not rs:
        raise ValueError(f"{len(records)} steps, none left after skipping {skip}")
    step_s = sum(r["time/step"] for r in rs)
    trajectories = sum(r["rollout/trajectories"] for r in rs)
    out = {
        "steps": float(len(rs)),
        "s_per_step": step_s / len(rs),
        "trajectories_per_s": trajectories / step_s,
        "trained_tokens_per_s": sum(r["train/num_tokens"] for r in rs) / step_s,
        "trainer_idle_fraction": sum(r["time/rollout"] for r in rs) / step_s,
    }
    if "rollout/async_discarded_groups" in rs[-1]:
        out["discarded_groups"] = rs[-1]["rollout/async_discarded_groups"]
    return out


def _trainer_s_per_token(records: list[dict], skip: int, asynchronous: bool) -> float:
    """Trainer time per trained token over the steady steps. Sync: the busy experience + train
    time (its wall train time also holds the wait for the other ranks' rollouts). Async: the
    wall ``time/step - time/rollout`` (the trainer shares the cores with the background
    generation on this machine, which slows it down). The steps' token counts vary too little
    for a fixed + per-token fit to be determined."""
    rs = records[skip:]
    if asynchronous:
        seconds = sum(r["time/step"] - r["time/rollout"] for r in rs)
    else:
        seconds = sum(r["time_busy/experience"] + r["time_busy/train"] for r in rs)
    return seconds / max(sum(r["train/num_tokens"] for r in rs), 1.0)


def sim_inputs(config, records, prefill_ms, pace_ms, engines, engine_batch, skip, k=None):
    """The simulator's inputs from a measured run (``k``: its staleness if async): the pace,
    the engines' mean prefill, the trajectories of the task seeds in the order their groups
    start (group g = seed g in both modes; a trajectory's tokens = its task's turns x the
    measured tokens per turn), the run's own trainer time per token and mean push, and its
    steps. The per-turn overhead ``env_step_s`` is left to ``fit_turn_overhead``."""
    env = LongTailEnv(**config.env.kwargs)
    n, g = config.batch.prompts_per_step, config.batch.samples_per_prompt
    generated = sum(r["train/num_tokens"] for r in records)
    all_turns = sum(r["rollout/turns_mean"] * r["rollout/trajectories"] for r in records)
    per_turn = generated / max(all_turns, 1.0)
    # enough groups for every step the simulator may start (staleness and discards included)
    groups = n * (len(records) + 4 * ((k or 0) + 2))
    values = [max(1, round(len(env.task(s)) * per_turn)) for s in range(groups) for _ in range(g)]
    push = [r.get("sync/weight_push_s", 0.0) for r in records[skip:]]
    return {
        "num_engines": engines,
        "slots_per_engine": engine_batch,
        "decode_s_per_token": pace_ms / 1000.0,
        "prefill_s": prefill_ms / 1000.0,
        "lengths": {"kind": "sequence", "values": values},
        "tokens_per_turn": max(1, round(per_turn)),
        "group_size": g,
        "prompts_per_step": n,
        "train_s_fixed": 0.0,
        "train_s_per_token": _trainer_s_per_token(records, skip, k is not None),
        "push_s": sum(push) / max(len(push), 1),
        "num_steps": len(records),
        "mode": "sync" if k is None else "async",
        "max_staleness": k or 0,
        "seed": config.seed,
    }


def sim_s_per_step(inputs: dict[str, Any], env_step_s: float, skip: int) -> float:
    """The simulated s/step over the steps after the first ``skip`` (as measured)."""
    ends = simulate(SimConfig.from_dict({**inputs, "env_step_s": env_step_s})).step_end_s
    first = ends[skip - 1] if skip else 0.0
    return (ends[-1] - first) / (len(ends) - skip)


def fit_turn_overhead(inputs: dict[str, Any], measured_s: float, skip: int) -> float:
    """The per-turn overhead (HTTP round trip, agent loop, environment step: the one input the
    run does not measure) that makes the simulated sync s/step equal the measured one
    (bisection on [0, 1] s; the simulated time grows with it)."""
    lo, hi = 0.0, 1.0
    if sim_s_per_step(inputs, lo, skip) >= measured_s:
        return lo
    for _ in range(30):
        mid = (lo + hi) / 2
        if sim_s_per_step(inputs, mid, skip) < measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_async_"))
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(CONFIG, [f"steps={args.steps}"])
    model_json = out / "model.json"
    model_json.write_text(json.dumps(config.model.to_dict()))
    procs = paced_engines(args, out, model_json, config.rollout.max_context)
    runs: dict[str, Any] = {}
    try:
        for proc in procs:
            proc.wait_healthy(timeout_s=180)
        urls = [p.url for p in procs]
        modes = [("sync", ["rollout.mode=sync"], 0)] + [
            (f"async_k{k}", ["rollout.mode=async", f"rollout.max_staleness={k}"], k)
            for k in args.staleness
        ]
        for name, overrides, k in modes:
            before = server_infos(urls)
            start = time.perf_counter()
            records = train_run(name, urls, out, [f"steps={args.steps}", *overrides], args.nproc)
            pacing = pacing_between(before, server_infos(urls))
            runs[name] = {
                "k": k,
                "measured": steady(records, args.skip),
                "pacing": pacing,
                "wall_s": time.perf_counter() - start,
                "records": records,
            }
    finally:
        for proc in procs:
            proc.stop(stop_timeout_s=20)
    sync = runs["sync"]
    prefill_ms = sync["pacing"]["mean_prefill_ms"]
    common = (prefill_ms, args.pace_ms, args.engines, args.engine_batch, args.skip)
    sync_inputs = sim_inputs(config, sync["records"], *common)
    overhead = fit_turn_overhead(sync_inputs, sync["measured"]["s_per_step"], args.skip)
    rows = []
    for name, r in runs.items():
        k = None if name == "sync" else r["k"]
        inputs = sim_inputs(config, r["records"], *common, k=k)
        sim_s = sim_s_per_step(inputs, overhead, args.skip)
        measured = r["measured"]["s_per_step"]
        rows.append(
            {
                "run": name,
                **r["measured"],
                "paced_decode_steps": r["pacing"]["decode_steps"],
                "pace_overruns": r["pacing"]["overruns"],
                "speedup_vs_sync": sync["measured"]["s_per_step"] / measured,
                "sim_s_per_step": sim_s,
                "sim_error": (sim_s - measured) / measured,
            }
        )
    for row in rows:
        row["sim_speedup_vs_sync"] = rows[0]["sim_s_per_step"] / row["sim_s_per_step"]
    env = LongTailEnv(**config.env.kwargs)
    return {
        "label": f"PACED engines: every decode step >= {args.pace_ms:g} ms (measured here)",
        "setting": {
            "config": str(CONFIG.relative_to(ROOT)),
            "engines": args.engines,
            "engine_batch": args.engine_batch,
            "trainer_processes": args.nproc,
            "steps": args.steps,
            "steady_steps_from": args.skip + 1,
            "prompts_per_step": config.batch.prompts_per_step,
            "samples_per_prompt": config.batch.samples_per_prompt,
            "turn_distribution": env.turn_distribution(),
        },
        "rows": rows,
        "sim_inputs": {k: v for k, v in sync_inputs.items() if k != "lengths"}
        | {"fitted_turn_overhead_s": overhead, "mean_prefill_ms": prefill_ms},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megatron-earl bench async", description=__doc__.split("\n")[0]
    )
    p.add_argument("--pace-ms", type=float, default=30.0, help="paced decode step (ms)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=1, help="warm-up steps excluded")
    p.add_argument("--staleness", default="1,2", help="async runs: comma-separated k")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--engine-batch", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        args.staleness = [int(x) for x in args.staleness.split(",") if x]
    except ValueError:
        p.error(f"--staleness {args.staleness!r}: comma-separated integers >= 0, e.g. 1,2")
    if any(k < 0 for k in args.staleness) or args.steps <= args.skip or args.pace_ms <= 0:
        p.error("need --staleness values >= 0, --steps > --skip, --pace-ms > 0")
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(result["label"])
    print(json.dumps(result["setting"]))
    head = ("run", "s_per_step", "trajectories_per_s", "trainer_idle_fraction",
            "speedup_vs_sync", "sim_s_per_step", "sim_error", "pace_overruns")  # fmt: skip
    print(" | ".join(head))
    for row in result["rows"]:
        print(
            " | ".join(f"{row[h]:.3f}" if isinstance(row[h], float) else str(row[h]) for h in head)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
