"""``megatron-earl bench relay``: the trainer's stall per weight publish, relays vs the direct
push to every engine, with real processes (``serve`` engines, ``relay`` processes).

    megatron-earl bench relay [--engines 2,4,8] [--repeats 3] [--engines-per-relay 4] [--json F]

Per engine count N: N ``megatron-earl serve`` engines (random weights of ``--model``'s shape),
a root relay and ceil(N / engines-per-relay) relays that pull from it, each feeding its share of
the engines. Then ``--repeats`` times, alternating:

- **direct**: the ``tensor`` transport pushes the weights to all N engines (pause ->
  ``update_weights_from_tensor`` per bucket -> continue -> version read back). The trainer is
  blocked for all of it: that is its stall.
- **relay**: the ``relay`` transport in the asynchronous loop's mode publishes once to the root
  (encode + upload + commit): its stall. Then, not counted as stall, the time until every
  engine reports the version (``propagation_s``: the relays pull and load on their own).

Engines are idle during the pushes (no request to pause), so the direct stall is a lower bound
of what a busy engine fleet costs. Every cost of each side is in its figure: encoding, HTTP,
checksums, the engines' loading, the version read-back.

Two projections to 256-1024 engines, both MODELLED, not measured:

1. *This transport scaled up*: the direct stall is the line ``a + b * N`` fitted to the
   measured points (one trainer sends N copies over HTTP), the relay stall is the median
   measured publish (independent of N by construction), the relay propagation ``levels x`` the
   measured per-hop time of a tree with ``--engines-per-relay`` fan-out. Real clusters push
   with NCCL broadcast, whose bandwidth term does not grow with N: this line is the HTTP
   transport's, the one that ran here.
2. *The pipeline simulator of the asynchronous mode* (``pipeline_sim``, with
   ``bench.async_sim.Assumptions``: 32B model, engines of 4 GPUs, 3/4 of the GPUs on rollout,
   async with ``max_staleness`` 1): the direct push is order 7's assumption (a 4 s NCCL push
   of 64 GB, trainer blocked and every engine paused for it); with relays the trainer is
   blocked for ``SIM_PUBLISH_S`` (its shards copied to relays on its own nodes) and each engine
   paused for ``SIM_ENGINE_LOAD_S`` (a load from the relay on its node). Both are assumptions
   stated here, not measurements; the simulator's output is throughput (trajectories/s).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.models.hf_mapping import global_shapes
from megatron_earl.rollout.sglang.client import SGLangClient
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess
from megatron_earl.rollout.weights.relay.launch import RelayLaunch, RelayProcess
from megatron_earl.rollout.weights.relay.publisher import wait_for_engines
from megatron_earl.rollout.weights.sync import hf_named_tensors
from megatron_earl.rollout.weights.transports import build_transport
from megatron_earl.testing.distributed import free_port

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=256,
    ffn_hidden_size=1024,
    num_attention_heads=8,
    vocab_size=8192,
    make_vocab_size_divisible_by=128,
)
PROJECTED = (256, 512, 1024)
SIM_PUBLISH_S = 1.0
"""Assumed trainer stall of one publish into node-local relays (64 GB of shards over PCIe)."""
SIM_ENGINE_LOAD_S = 1.0
"""Assumed pause of one engine loading a version from its node's relay."""
SIM_STEPS = 4


def _weights(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.02 for k, s in global_shapes(model).items()}


def measure(n: int, args: argparse.Namespace, tmp: Path, model: ModelConfig) -> dict:
    (tmp / "model.json").write_text(json.dumps(model.to_dict()))
    common = ("--model-config", str(tmp / "model.json"), "--max-seq-len", "64")
    env = {"OMP_NUM_THREADS": "1"}
    engines = [
        ServerProcess(
            LaunchConfig(
                model_path="random",
                port=free_port(),
                module="megatron_earl.rollout.serve.server",
                extra_args=(*common, "--max-weight-body-mb", "4096"),
            ),
            log_path=str(tmp / f"e{n}-{i}.log"),
            env=env,
            rebind_on_conflict=True,
        )
        for i in range(n)
    ]
    relays: list[RelayProcess] = []
    try:
        for e in engines:
            e.wait_healthy(timeout_s=300)
        urls = [e.url for e in engines]
        fast = ("--engine-check-s", "0.5", "--poll-wait-s", "5")
        root = RelayProcess(
            RelayLaunch(free_port(), extra_args=fast),
            log_path=str(tmp / f"root{n}.log"),
            rebind_on_conflict=True,
        )
        relays.append(root)
        root.wait_healthy(timeout_s=60, path="/health")
        per = args.engines_per_relay
        for j in range(math.ceil(n / per)):
            child = RelayProcess(
                RelayLaunch(
                    free_port(),
                    upstreams=(root.url,),
                    engines=tuple(urls[j * per : (j + 1) * per]),
                    extra_args=fast,
                ),
                log_path=str(tmp / f"relay{n}-{j}.log"),
                rebind_on_conflict=True,
            )
            relays.append(child)
            child.wait_healthy(timeout_s=60, path="/health")
        return asyncio.run(_rounds(urls, root.url, args, tmp, model))
    finally:
        for p in [*relays, *engines]:
            p.stop(stop_timeout_s=10)


async def _rounds(urls, root_url, args, tmp, model) -> dict:
    bucket = args.bucket_mb << 20
    direct = build_transport(SGLangConfig(weight_update="tensor", bucket_bytes=bucket), model, tmp)
    relay = build_transport(
        SGLangConfig(weight_update="relay", relay_urls=(root_url,), bucket_bytes=bucket), model, tmp
    )
    relay.asynchronous = True
    clients = [SGLangClient(u) for u in urls]
    out = {"direct_s": [], "relay_stall_s": [], "propagation_s": [], "bytes": 0}
    try:
        warm = _weights(model, 99)  # first connections and the relay transport's first push
        await direct.push(clients, hf_named_tensors(warm, model), 1)  # (which waits) excluded
        await relay.push(clients, hf_named_tensors(warm, model), 2)
        version = 2
        for r in range(args.repeats):
            full = _weights(model, r)
            version += 1
            start = time.perf_counter()
            stats = await direct.push(clients, hf_named_tensors(full, model), version)
            out["direct_s"].append(time.perf_counter() - start)
            out["bytes"] = stats.bytes_sent
            version += 1
            start = time.perf_counter()
            await relay.push(clients, hf_named_tensors(full, model), version)
            out["relay_stall_s"].append(time.perf_counter() - start)
            await wait_for_engines(clients, version, 600)
            out["propagation_s"].append(time.perf_counter() - start)
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    return out


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a + b * n."""
    ns, ys = [p[0] for p in points], [p[1] for p in points]
    if len(points) == 1:
        return 0.0, ys[0] / ns[0]
    mean_n, mean_y = statistics.fmean(ns), statistics.fmean(ys)
    b = sum((n - mean_n) * (y - mean_y) for n, y in points) / sum((n - mean_n) ** 2 for n in ns)
    return mean_y - b * mean_n, b


def summarize(measured: dict[int, dict], engines_per_relay: int) -> dict:
    rows = {}
    for n, m in measured.items():
        direct, stall = statistics.median(m["direct_s"]), statistics.median(m["relay_stall_s"])
        rows[n] = {
            "engines": n,
            "relays": 1 + math.ceil(n / engines_per_relay),
            "bytes_per_version": m["bytes"],
            "direct_stall_s": direct,
            "relay_stall_s": stall,
            "stall_ratio_direct_over_relay": direct / stall,
            "relay_propagation_s": statistics.median(m["propagation_s"]),
            "samples": m,
        }
    a, b = _fit([(n, r["direct_stall_s"]) for n, r in rows.items()])
    stall = statistics.median(r["relay_stall_s"] for r in rows.values())
    # per hop: a relay's pull + its engines' load, from the measured two-level tree
    hop = statistics.median(r["relay_propagation_s"] - r["relay_stall_s"] for r in rows.values())
    projection = []
    for n in PROJECTED:
        hops = 1 + math.ceil(math.log(max(n / engines_per_relay, 1), engines_per_relay))
        direct = a + b * n
        projection.append(
            {
                "engines": n,
                "direct_stall_s": direct,
                "relay_stall_s": stall,
                "stall_ratio_direct_over_relay": direct / stall,
                "relay_tree_levels": hops,
                "relay_propagation_s": stall + hops * hop,
            }
        )
    return {
        "measured": rows,
        "simulated_MODELLED": simulated(),
        "projection_MODELLED": {
            "direct_fit": {"a_s": a, "b_s_per_engine": b},
            "relay_stall_s": stall,
            "per_hop_s": hop,
            "rows": projection,
        },
    }


def simulated(engines: tuple[int, ...] = PROJECTED, steps: int = SIM_STEPS) -> list[dict]:
    """The pipeline simulator's async throughput, direct push vs relays (module docstring)."""
    from megatron_earl.bench.async_sim import Assumptions
    from megatron_earl.bench.pipeline_sim import simulate

    a = Assumptions()
    rows = []
    for n in engines:
        gpus = 2 * round(n * a.gpus_per_engine / a.rollout_fraction / 2)
        direct = a.async_config(gpus, steps, seed=0, k=1)
        relay = dataclasses.replace(direct, push_s=SIM_PUBLISH_S, engine_pause_s=SIM_ENGINE_LOAD_S)
        d, r = simulate(direct).to_dict(), simulate(relay).to_dict()
        rows.append(
            {
                "engines": direct.num_engines,
                "gpus": gpus,
                "direct_push_s": direct.push_s,
                "relay_publish_s": SIM_PUBLISH_S,
                "relay_engine_load_s": SIM_ENGINE_LOAD_S,
                "direct_trajectories_per_s": d["trajectories_per_s"],
                "relay_trajectories_per_s": r["trajectories_per_s"],
                "throughput_ratio_relay_over_direct": (
                    r["trajectories_per_s"] / d["trajectories_per_s"]
                ),
                "direct_push_fraction": d["push_fraction"],
                "relay_push_fraction": r["push_fraction"],
            }
        )
    return rows


def report(summary: dict, args: argparse.Namespace) -> str:
    m = summary["measured"]
    first = next(iter(m.values()))
    lines = [
        f"bench relay: {platform.machine()} {torch.get_num_threads()} threads, "
        f"{first['bytes_per_version'] / 2**20:.1f} MiB per version, buckets of {args.bucket_mb} "
        f"MiB, {args.repeats} repeats, engines idle, <= {args.engines_per_relay} engines per relay",
        "MEASURED (real processes)",
        f"{'engines':>8} {'relays':>7} {'direct stall s':>15} {'relay stall s':>14} "
        f"{'ratio':>6} {'propagation s':>14}",
    ]
    for r in m.values():
        lines.append(
            f"{r['engines']:>8} {r['relays']:>7} {r['direct_stall_s']:>15.3f} "
            f"{r['relay_stall_s']:>14.3f} {r['stall_ratio_direct_over_relay']:>6.2f} "
            f"{r['relay_propagation_s']:>14.3f}"
        )
    p = summary["projection_MODELLED"]
    lines += [
        f"PROJECTED (MODELLED: direct = {p['direct_fit']['a_s']:.3f} + "
        f"{p['direct_fit']['b_s_per_engine']:.3f} s x engines fitted above; relay stall = "
        f"{p['relay_stall_s']:.3f} s measured; propagation = stall + levels x "
        f"{p['per_hop_s']:.3f} s)",
    ]
    for r in p["rows"]:
        lines.append(
            f"{r['engines']:>8} {'':>7} {r['direct_stall_s']:>15.3f} {r['relay_stall_s']:>14.3f} "
            f"{r['stall_ratio_direct_over_relay']:>6.1f} {r['relay_propagation_s']:>14.3f}"
        )
    lines.append(
        f"SIMULATED (MODELLED: pipeline simulator, async k=1, 32B on engines of 4 GPUs; direct "
        f"push 4 s with every engine paused; relays: trainer blocked {SIM_PUBLISH_S:g} s, each "
        f"engine paused {SIM_ENGINE_LOAD_S:g} s -- assumptions, not measurements)"
    )
    lines.append(
        f"{'engines':>8} {'gpus':>6} {'direct traj/s':>14} {'relay traj/s':>13} {'ratio':>6} "
        f"{'trainer push share direct/relay':>32}"
    )
    for r in summary["simulated_MODELLED"]:
        lines.append(
            f"{r['engines']:>8} {r['gpus']:>6} {r['direct_trajectories_per_s']:>14.1f} "
            f"{r['relay_trajectories_per_s']:>13.1f} "
            f"{r['throughput_ratio_relay_over_direct']:>6.2f} "
            f"{r['direct_push_fraction']:>15.3f} / {r['relay_push_fraction']:.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megatron-earl bench relay", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--engines", default="2,4,8", help="engine counts, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines-per-relay", type=int, default=4)
    p.add_argument("--bucket-mb", type=int, default=16)
    p.add_argument("--json", default=None, help="write every measurement and the summary here")
    args = p.parse_args(argv)
    try:
        args.engine_counts = [int(x) for x in args.engines.split(",") if x.strip()]
    except ValueError:
        p.error(f"--engines takes comma-separated integers, got {args.engines!r}")
    if not args.engine_counts or min(args.engine_counts) < 1:
        p.error(f"--engines needs counts >= 1, got {args.engines!r}")
    for name in ("repeats", "engines_per_relay", "bucket_mb"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp:
        measured = {n: measure(n, args, Path(tmp), MODEL) for n in args.engine_counts}
    summary = summarize(measured, args.engines_per_relay)
    print(report(summary, args))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
