"""Dispatch benchmark: decentralized (layout-aware, point to point) vs centralized (gather to
rank 0, then scatter), measured on N local gloo processes and projected to 16-1024 GPUs by a
network model.

    python scripts/bench_dispatch.py                    # 8 processes, 64 samples, 32K context
    python scripts/bench_dispatch.py --world 4 --samples 32 --json

The batch is agentic-like (``reference.agentic_lengths``: long-tailed lengths up to the context
cap; int64 tokens, bool mask, 3 float32 log-prob fields, uint8 turn ids, per-sample reward,
advantage, version). Sample ``s`` starts on rank ``s % world`` (each rank drove its own rollouts).
Measured per variant: wall time (median over repeats, barrier to barrier), bytes sent and received
by the busiest rank. The decentralized dispatch also pays a metadata all-gather and planning on
every rank (timed separately, "planning"; the ratio is given with and without it); the centralized
variant is given the plan for free. The projection plans the same kind of batch at each cluster
size (destination ``--proj-layout`` with dp filling the cluster) and times both variants' stages
with ``netmodel.NetworkModel`` (parameters printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from megatron_earl.dispatch.centralized import centralized_stages
from megatron_earl.dispatch.netmodel import NetworkModel
from megatron_earl.dispatch.plan import Destination, PlanConfig, SourceMeta, plan_dispatch
from megatron_earl.dispatch.reference import agentic_lengths, agentic_schema, make_batches
from megatron_earl.dispatch.route import RouteConfig
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.layout import ParallelLayout


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megatron-earl bench dispatch", description=__doc__.split("\n")[0]
    )
    p.add_argument("--world", type=int, default=8, help="local gloo processes")
    p.add_argument("--layout", default="tp2cp2pp1", help="destination layout; dp fills --world")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-len", type=int, default=32768, help="context cap (tokens)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, default=None, help="local routing (None: 1 node)")
    p.add_argument("--fanout", default="node_relay", choices=["node_relay", "direct"])
    p.add_argument("--proj-layout", default="tp4cp2pp2", help="projection layout; dp fills")
    p.add_argument("--proj-gpus", default="16,32,64,128,256,512,1024")
    p.add_argument("--proj-samples-per-dp", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbps", type=float, default=450.0)
    p.add_argument("--nic-gbps", type=float, default=50.0)
    p.add_argument("--latency-us", type=float, default=10.0)
    p.add_argument("--no-measure", action="store_true", help="projection only")
    p.add_argument("--json", action="store_true", help="print one machine-readable line")
    return p.parse_args(argv)


def _fill(text: str, world: int) -> ParallelLayout:
    base = ParallelLayout.parse(text)
    return ParallelLayout(tp=base.tp, cp=base.cp, pp=base.pp, dp=world // base.model_parallel_size)


def _busiest(traffic: dict[str, list[int]]) -> dict[str, int]:
    r = max(range(len(traffic["sent"])), key=lambda r: traffic["sent"][r] + traffic["recv"][r])
    return {"rank": r, "sent": traffic["sent"][r], "recv": traffic["recv"][r]}


def _busiest_total(traffic: dict[str, list[int]]) -> int:
    return max(a + b for a, b in zip(traffic["sent"], traffic["recv"]))


def _bench_body(opts: dict) -> dict | None:
    """Runs on every rank (module-level for run_distributed)."""
    import torch.distributed as dist

    from megatron_earl.dispatch.batch import tensors_equal
    from megatron_earl.dispatch.execute import execute, plan_for

    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = agentic_lengths(opts["samples"], opts["max_len"], opts["seed"])
    owners = [list(range(r, opts["samples"], world)) for r in range(world)]
    _, batches = make_batches(agentic_schema(), lengths, owners, opts["seed"], only_rank=rank)
    batch = batches[0]
    dest = Destination(_fill(opts["layout"], world))
    cfg = PlanConfig(route=RouteConfig(opts["fanout"], opts["ranks_per_node"]))
    times: dict[str, list[float]] = {"planning": [], "decentralized": [], "centralized": []}
    for _ in range(opts["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        plan = plan_for(batch, dest, cfg)
        dist.barrier()
        t1 = time.perf_counter()
        local = execute(plan, batch)
        dist.barrier()
        t2 = time.perf_counter()
        central = execute(plan, batch, centralized=True)
        dist.barrier()
        t3 = time.perf_counter()
        times["planning"].append(t1 - t0)
        times["decentralized"].append(t2 - t1)
        times["centralized"].append(t3 - t2)
    for a, b in zip(local.micro_batches, central.micro_batches):
        assert all(tensors_equal(a.fields[k], b.fields[k]) for k in a.fields), "variants differ"
    gathered = [None] * world
    dist.all_gather_object(gathered, times, group=host_group())
    if rank != 0:
        return None
    med = {
        k: statistics.median(max(g[k][i] for g in gathered) for i in range(opts["repeats"]))
        for k in times
    }
    return {
        "median_s": med,
        "decentralized": _busiest(plan.traffic()),
        "centralized": _busiest(plan.traffic(centralized_stages(plan))),
        "tokens": sum(lengths),
        "bytes_total": sum(plan.traffic(centralized_stages(plan)[:1])["recv"]),
    }


def project(args: argparse.Namespace, model: NetworkModel) -> list[dict]:
    """Plan the batch at each cluster size and time both variants with the network model."""
    schema = agentic_schema()
    rows = []
    for gpus in [int(g) for g in args.proj_gpus.split(",") if g]:
        layout = _fill(args.proj_layout, gpus)
        num = max(64, args.proj_samples_per_dp * layout.dp)
        lengths = agentic_lengths(num, args.max_len, args.seed)
        sources = [
            SourceMeta(tuple(ids), tuple(lengths[s] for s in ids), tuple(ids))
            for ids in (range(r, num, gpus) for r in range(gpus))
        ]
        cfg = PlanConfig(route=RouteConfig(args.fanout, model.gpus_per_node))
        plan = plan_dispatch(sources, schema, Destination(layout), cfg)
        central = centralized_stages(plan)
        dec_s, cen_s = model.seconds(plan.stages, schema), model.seconds(central, schema)
        rows.append(
            {
                "gpus": gpus,
                "layout": str(layout),
                "samples": num,
                "tokens": sum(lengths),
                "decentralized_s": dec_s,
                "centralized_s": cen_s,
                "ratio": cen_s / dec_s,
                "busiest_bytes_decentralized": _busiest_total(plan.traffic()),
                "busiest_bytes_centralized": _busiest_total(plan.traffic(central)),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Console entry (``megatron-earl bench dispatch``): print the report; exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Measure and project; print the report (or one JSON line with ``--json``); return it."""
    args = _args(argv)
    model = NetworkModel(args.gpus_per_node, args.nvlink_gbps, args.nic_gbps, args.latency_us)
    out: dict = {
        "setting": {
            "world": args.world,
            "layout": str(_fill(args.layout, args.world)),
            "samples": args.samples,
            "max_len": args.max_len,
            "repeats": args.repeats,
            "fanout": args.fanout,
            "backend": "gloo (local processes)",
        },
        "network_model": model.__dict__,
    }
    if not args.no_measure:
        from megatron_earl.testing.distributed import run_distributed

        opts = {
            k: getattr(args, k)
            for k in ("layout", "samples", "max_len", "seed", "repeats", "ranks_per_node", "fanout")
        }
        m = run_distributed(_bench_body, args.world, args=(opts,), timeout_s=1800)[0]
        dec, cen = m["decentralized"], m["centralized"]
        med = m["median_s"]
        m["ratio_time"] = med["centralized"] / med["decentralized"]
        m["ratio_time_with_planning"] = med["centralized"] / (
            med["decentralized"] + med["planning"]
        )
        m["ratio_busiest_bytes"] = (cen["sent"] + cen["recv"]) / (dec["sent"] + dec["recv"])
        out["measured"] = m
    out["projection"] = project(args, model)
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    return out


def _print(out: dict) -> None:
    s = out["setting"]
    print(f"dispatch benchmark: {s['world']} gloo processes -> {s['layout']}, ", end="")
    print(f"{s['samples']} samples, context {s['max_len']}, {s['repeats']} repeats")
    m = out.get("measured")
    if m:
        med = m["median_s"]
        print(f"  batch: {m['tokens']} tokens, {m['bytes_total'] / 2**20:.1f} MiB")
        print(f"  metadata all-gather + planning (every rank): {med['planning'] * 1e3:8.1f} ms")
        for v in ("decentralized", "centralized"):
            b = m[v]
            print(f"  {v:14s} median {med[v] * 1e3:8.1f} ms   busiest rank {b['rank']}: ", end="")
            print(f"sent {b['sent'] / 2**20:7.1f} MiB, recv {b['recv'] / 2**20:7.1f} MiB")
        print(f"  ratio centralized/decentralized: time {m['ratio_time']:.2f}x ", end="")
        print(f"({m['ratio_time_with_planning']:.2f}x counting planning), ", end="")
        print(f"busiest-rank bytes {m['ratio_busiest_bytes']:.2f}x")
    nm = out["network_model"]
    print(
        f"network model: {nm['gpus_per_node']} GPUs/node, NVLink {nm['nvlink_gbps']} GB/s per ",
        end="",
    )
    print(f"GPU, NIC {nm['nic_gbps']} GB/s per node, {nm['latency_us']} us per message")
    head = ("GPUs", "layout", "samples", "decentral ms", "central ms", "ratio")
    print("  {:>5} {:>18} {:>7} {:>13} {:>11} {:>7}".format(*head))
    for r in out["projection"]:
        row = (r["gpus"], r["layout"], r["samples"], r["decentralized_s"] * 1e3)
        print("  {:5d} {:>18} {:7d} {:13.3f}".format(*row), end="")
        print(f" {r['centralized_s'] * 1e3:11.3f} {r['ratio']:6.1f}x")
