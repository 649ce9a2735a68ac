"""``megatron-earl bench repack``: the real asynchronous trainer on PACED engines fed by relays,
with ``rollout.repack.policy`` none, drain and repack, on the long-tailed workload: throughput
and engine utilisation over time (Laminar's long-tail repack, docs/relay.md).

    megatron-earl bench repack [--engines 4] [--pace-ms 40] [--steps 10] [--plot F.png] [--json]

Setting: ``--engines`` ``megatron-earl serve`` processes with ``--pace-decode-ms`` (every
decode step lasts at least the pace after the real forward, as on a GPU whatever the CPU
contention: labelled PACED), started once; per run a root relay and one relay per engine
(``--release-holders`` = ``--nproc`` for drain and repack), started fresh; the trainer under
``megatron-earl train --nproc`` on ``configs/bench_async_longtail.yaml`` (lognormal turn counts:
p50 2, p90 7, p99 16) with ``rollout.mode=async``, ``rollout.max_staleness=--staleness``,
``rollout.sglang.weight_update=relay`` and the policy, the same seed. Each run starts with an
SFT warm start (not timed) and publishes its own weights.

Measured per run over the steady steps (the first ``--skip`` excluded): s/step, trajectories
and trained tokens per second (each s/step is the trainer's whole step: the wait for groups,
the publish, experience, train), the groups discarded as too stale, the engines' paced decode
steps and overruns, and the placement's counters (repack moves, trajectories moved, releases,
trajectories that waited for an engine on the newest version and their total wait).
Utilisation (drain and repack, from each rank's ``repack_rank<r>.jsonl``, sampled every
``rollout.repack.interval_s``): per engine, the producers' requests in flight on it (summed over
ranks): the engine's decode batch. Reported: the mean batch per engine and the fraction of
engine-time at a batch of at most 1 (an engine held by a tail). ``--plot`` draws the batch of
every engine over time, one panel per policy.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_earl.bench.async_rl import (
    CONFIG,
    KEY,
    paced_engines,
    pacing_between,
    server_infos,
    steady,
    train_run,
)
from megatron_earl.config.loader import load_config
from megatron_earl.config.vocab import RepackPolicy
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.testing.distributed import free_port

POLICIES = tuple(RepackPolicy)
RELAY_ARGS = ("--engine-check-s", "0.5", "--poll-wait-s", "5")


def _relays(urls: list[str], holders: int, out: Path, name: str) -> list[RelayProcess]:
    """A root relay and one relay per engine (pulling from the root), healthy."""
    env = {"OMP_NUM_THREADS": "1", "SGLANG_API_KEY": KEY}
    root = RelayProcess(
        RelayLaunch(free_port(), extra_args=RELAY_ARGS),
        log_path=str(out / f"{name}_relay_root.log"),
        env=env,
    )
    relays = [root]
    try:
        root.wait_healthy(timeout_s=60, path="/health")
        for i, url in enumerate(urls):
            extra = (*RELAY_ARGS, "--release-holders", str(holders))
            launch = RelayLaunch(
                free_port(), upstreams=(root.url,), engines=(url,), extra_args=extra
            )
            relay = RelayProcess(launch, log_path=str(out / f"{name}_relay{i}.log"), env=env)
            relays.append(relay)
            relay.wait_healthy(timeout_s=60, path="/health")
    except BaseException:
        for r in relays:
            r.stop(stop_timeout_s=10)
        raise
    return relays


def utilisation(run_dir: Path, engines: int, bin_s: float = 0.25) -> dict[str, Any]:
    """Every engine's batch (requests in flight from all ranks) over time, from the ranks'
    placement timelines: ``{"t": [...], "batch": [[per engine] per bin], "mean_batch",
    "tail_fraction"}`` (bins of ``bin_s``; a rank's last sample in a bin stands for it)."""
    samples: dict[str, list[tuple[float, list[int]]]] = {}
    for path in sorted(run_dir.glob("repack_rank*.jsonl")):
        for line in path.open():
            record = json.loads(line)
            if "engines" in record:
                loads = [e[2] for e in record["engines"]]
                samples.setdefault(record["holder"], []).append((record["t"], loads))
    if not samples:
        return {"t": [], "batch": [], "mean_batch": 0.0, "tail_fraction": 0.0}
    start = min(s[0][0] for s in samples.values())
    end = max(s[-1][0] for s in samples.values())
    bins = int((end - start) / bin_s) + 1
    per_rank = {h: [None] * bins for h in samples}
    for holder, rows in samples.items():
        for t, loads in rows:
            per_rank[holder][int((t - start) / bin_s)] = loads
    batch = []
    for b in range(bins):
        total = [0] * engines
        for rows in per_rank.values():
            last = next((rows[i] for i in range(b, -1, -1) if rows[i] is not None), None)
            for e, n in enumerate(last or []):
                total[e] += n
        batch.append(total)
    cells = [n for row in batch for n in row]
    return {
        "t": [round(b * bin_s, 3) for b in range(bins)],
        "batch": batch,
        "mean_batch": sum(cells) / len(cells),
        "tail_fraction": sum(1 for n in cells if n <= 1) / len(cells),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["rows"] if r["utilisation"]["t"]]
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True, squeeze=False
    )
    for ax, row in zip(axes[:, 0], runs, strict=True):
        u = row["utilisation"]
        for e in range(len(u["batch"][0])):
            ax.plot(u["t"], [b[e] for b in u["batch"]], lw=0.8, label=f"engine {e}")
        ax.set_ylabel("requests in flight")
        ax.set_title(
            f"{row['run']}: {row['trajectories_per_s']:.1f} trajectories/s, mean batch "
            f"{u['mean_batch']:.1f}, engine-time at batch <= 1: {u['tail_fraction']:.0%}",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the run's first placement sample")
    fig.suptitle(result["label"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_repack_"))
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(CONFIG, [f"steps={args.steps}"])
    (out / "model.json").write_text(json.dumps(config.model.to_dict()))
    engines = paced_engines(args, out, out / "model.json", config.rollout.max_context)
    rows = []
    try:
        for e in engines:
            e.wait_healthy(timeout_s=180)
        urls = [e.url for e in engines]
        for policy in args.policies:
            holders = 0 if policy == RepackPolicy.NONE else args.nproc
            relays = _relays(urls, holders, out, policy)
            overrides = [
                f"steps={args.steps}",
                "rollout.mode=async",
                f"rollout.max_staleness={args.staleness}",
                "rollout.sglang.weight_update=relay",
                f"rollout.sglang.relay_urls=[{relays[0].url}]",
                f"rollout.repack.policy={policy}",
                f"rollout.repack.below={args.below}",
            ]
            if policy != RepackPolicy.NONE:
                feeds = ",".join(r.url for r in relays[1:])
                overrides.append(f"rollout.sglang.engine_relays=[{feeds}]")
            try:
                before = server_infos(urls)
                start = time.perf_counter()
                records = train_run(policy, urls, out, overrides, args.nproc)
                pacing = pacing_between(before, server_infos(urls))
            finally:
                for r in reversed(relays):
                    r.stop(stop_timeout_s=10)
            last = records[-1]
            rows.append(
                {
                    "run": policy,
                    **steady(records, args.skip),
                    "paced_decode_steps": pacing["decode_steps"],
                    "pace_overruns": pacing["overruns"],
                    "wall_s": time.perf_counter() - start,
                    "mixed_version_trajectories": last["rollout/async_mixed_version_trajectories"],
                    **{
                        k.split("/")[1]: v
                        for k, v in last.items()
                        if k.startswith("rollout/repack_")
                    },
                    "utilisation": utilisation(out / policy, args.engines),
                }
            )
    finally:
        for e in engines:
            e.stop(stop_timeout_s=20)
    base = next((r for r in rows if r["run"] == "drain"), rows[0])
    for row in rows:
        row["speedup_vs_drain"] = base["s_per_step"] / row["s_per_step"]
    return {
        "label": f"PACED engines: every decode step >= {args.pace_ms:g} ms (measured here)",
        "setting": {
            "config": str(CONFIG.name),
            "engines": args.engines,
            "engine_batch": args.engine_batch,
            "trainer_processes": args.nproc,
            "max_staleness": args.staleness,
            "repack_below": args.below,
            "steps": args.steps,
            "steady_steps_from": args.skip + 1,
            "prompts_per_step": config.batch.prompts_per_step,
            "samples_per_prompt": config.batch.samples_per_prompt,
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megatron-earl bench repack", description=__doc__.split("\n")[0]
    )
    p.add_argument("--pace-ms", type=float, default=40.0, help="paced decode step (ms)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--engine-batch", type=int, default=64, help="serve --max-batch-size")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps excluded")
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--below", type=int, default=2, help="rollout.repack.below")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--plot", default=None, help="write the utilisation plot here (PNG)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in args.policies if x not in POLICIES]
    if bad or not args.policies:
        p.error(f"--policies {bad or args.policies}: comma-separated from {POLICIES}")
    if args.engines < 2 or args.steps <= args.skip or args.pace_ms <= 0 or args.staleness < 0:
        p.error("need --engines >= 2, --steps > --skip, --pace-ms > 0, --staleness >= 0")
    result = run(args)
    if args.plot:
        plot(result, Path(args.plot))
    if args.json:
        print(json.dumps(result))
        return 0
    print(result["label"])
    print(json.dumps(result["setting"]))
    head = ("run", "s_per_step", "trajectories_per_s", "trained_tokens_per_s",
            "trainer_idle_fraction", "discarded_groups", "mixed_version_trajectories",
            "repack_moves", "repack_waits", "pace_overruns", "speedup_vs_drain")  # fmt: skip
    print(" | ".join(head) + " | mean_batch | batch<=1")
    for row in result["rows"]:
        cells = [row.get(h, "-") for h in head]
        u = row["utilisation"]
        print(
            " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells)
            + f" | {u['mean_batch']:.2f} | {u['tail_fraction']:.2f}"
        )
    if args.plot:
        print(f"utilisation plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
