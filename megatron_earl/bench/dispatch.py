"""Dispatch benchmark: decentralized vs centralized, every cost counted, measured and projected.

Decentralized (rank views, point to point) vs centralized (gather to rank 0, then scatter),
every cost counted on both sides; measured on N local gloo processes, checked against the
network model calibrated on this machine, and projected to 8-1024 GPUs.

    megatron-earl bench dispatch --world 8 --json       # the figures of docs/dispatch.md
    python scripts/bench_dispatch.py --world 4 --samples 128 --no-project   # a quick smoke run

Batch: long-tailed agentic trajectories (``reference.agentic_lengths``, up to ``--max-len``)
with the RL loop's fields (int64 tokens, bool loss mask, three float32 log-prob fields, uint8
turn ids; per-sample reward, advantage, policy version), ``--samples-per-prompt`` samples per
prompt (the group id). Sample ``s`` starts on rank ``s % world``.

Measured (each repeat, every rank; median over repeats of the slowest rank):

- decentralized = metadata all-gather + this rank's plan (``plan_for``) + ``execute`` (packing,
  point-to-point transfer, unpacking, CP padding);
- centralized = the same metadata all-gather and an unrouted view (``routed=False``) + the
  controller's work inside ``execute(centralized=True)``: rank 0 works out every rank's needs,
  receives and unpacks every sample, packs and sends each rank its part.

No plan cache is used (each repeat plans from scratch).
``ratio_time_with_planning`` (measured) and ``ratio_with_planning`` (projected) charge each path
its own planning as implemented; the projection also gives the ratio with the baseline charged
only the balance a controller must compute (``..._baseline_balance_only``, its per-rank slice
lists, O(ranks x pieces) of Python here, not counted) and with its planning free.

Calibration: ranks 0 and 1 time point-to-point messages (latency, bandwidth), four pairs at once
(what the host moves together); rank 0 alone a copy and the executor's per-field-slice cost.
``NetworkModel`` with those figures (``local_model``) predicts both paths' execute times.

Projection: the batch grows with the cluster (``--proj-samples-per-gpu``, 16: 2048 samples =
256 prompts x 8 at 128 GPUs); planning is *measured* by running the planner at that scale in
this process (decentralized: the slowest of a few rank views; centralized: the root's view plus
its stages; TransferQueue: the store's balance), the metadata all-gather and the transfers are
*modelled*. The third variant, "transfer_queue" (TransferQueue in verl/ROLL), is a central
metadata store with decentralized data pulls: every rank sends its metadata to the store, the
store balances and answers every consumer, and each consumer pulls whole samples of its DP share
(no CP slicing, no relay inside a node) straight from the producers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

from megatron_earl.config.vocab import Fanout
from megatron_earl.dispatch.centralized import centralized_stages
from megatron_earl.dispatch.netmodel import NetworkModel
from megatron_earl.dispatch.plan import plan_dispatch
from megatron_earl.dispatch.reference import agentic_lengths, agentic_schema, make_batches
from megatron_earl.dispatch.route import RouteConfig
from megatron_earl.dispatch.spec import Destination, PlanConfig, SourceMeta
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.layout import ParallelLayout

PATHS = ("decentralized", "centralized")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megatron-earl bench dispatch", description=__doc__.split("\n")[0]
    )
    p.add_argument("--world", type=int, default=8, help="local gloo processes")
    p.add_argument("--layout", default="tp2cp2pp1", help="destination layout; dp fills --world")
    p.add_argument("--samples", type=int, default=2048, help="local batch (256 prompts x 8)")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-len", type=int, default=32768, help="context cap (tokens)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, default=None, help="local routing (None: 1 node)")
    p.add_argument("--fanout", default=Fanout.NODE_RELAY, choices=list(Fanout))
    p.add_argument("--proj-layout", default="tp4cp2pp2", help="projection layout; dp fills")
    p.add_argument("--proj-gpus", default="8,16,32,64,128,256,512,1024")
    p.add_argument("--proj-samples-per-gpu", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbps", type=float, default=450.0)
    p.add_argument("--nic-gbps", type=float, default=50.0)
    p.add_argument("--latency-us", type=float, default=10.0)
    p.add_argument("--no-measure", action="store_true", help="projection only")
    p.add_argument("--no-project", action="store_true", help="local measurement only")
    p.add_argument("--json", action="store_true", help="print one machine-readable line")
    return p.parse_args(argv)


def _fill(text: str, world: int) -> ParallelLayout:
    """``text``'s tp, cp, pp with dp filling ``world``; on a world too small for them, pp, then
    cp, then tp halved until they fit."""
    base = ParallelLayout.parse(text)
    tp, cp, pp = base.tp, base.cp, base.pp
    while (world % (tp * cp * pp) and tp * cp * pp > 1) or tp * cp * pp > world:
        if pp > 1:
            pp //= 2
        elif cp > 1:
            cp //= 2
        else:
            tp //= 2
    return ParallelLayout(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp))


def _busiest(traffic: dict[str, list[int]]) -> dict[str, int]:
    r = max(range(len(traffic["sent"])), key=lambda r: traffic["sent"][r] + traffic["recv"][r])
    return {"rank": r, "sent": traffic["sent"][r], "recv": traffic["recv"][r]}


def _busiest_total(traffic: dict[str, list[int]]) -> int:
    return max(a + b for a, b in zip(traffic["sent"], traffic["recv"]))


def _sources(lengths: list[int], world: int, per_prompt: int) -> list[SourceMeta]:
    num = len(lengths)
    return [
        SourceMeta(tuple(ids), tuple(lengths[s] for s in ids), tuple(s // per_prompt for s in ids))
        for ids in (range(r, num, world) for r in range(world))
    ]


# ---------------------------------------------------------------------- local measurement


def _bench_body(opts: dict) -> dict | None:
    """Runs on every rank (module-level for run_distributed)."""
    import torch.distributed as dist

    from megatron_earl.dispatch.batch import tensors_equal
    from megatron_earl.dispatch.execute import execute, plan_for

    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = agentic_lengths(opts["samples"], opts["max_len"], opts["seed"])
    owners = [list(range(r, opts["samples"], world)) for r in range(world)]
    per_prompt = opts["samples_per_prompt"]
    _, batches = make_batches(
        agentic_schema(), lengths, owners, opts["seed"], per_prompt, only_rank=rank
    )
    batch = batches[0]
    dest = Destination(_fill(opts["layout"], world))
    cfg = PlanConfig(route=RouteConfig(opts["fanout"], opts["ranks_per_node"]))
    keys = [f"{p}_{k}" for p in PATHS for k in ("planning", "execute", "total")]
    times: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(opts["repeats"]):
        for path in PATHS:
            dist.barrier()
            t0 = time.perf_counter()
            plan = plan_for(batch, dest, cfg, routed=path == "decentralized")
            t1 = time.perf_counter()
            local = execute(plan, batch, centralized=path == "centralized")
            t2 = time.perf_counter()
            dist.barrier()
            t3 = time.perf_counter()
            times[f"{path}_planning"].append(t1 - t0)
            times[f"{path}_execute"].append(t2 - t1)
            times[f"{path}_total"].append(t3 - t0)
            if path == "decentralized":
                dec = local
            else:
                for a, b in zip(dec.micro_batches, local.micro_batches, strict=True):
                    assert all(tensors_equal(a.fields[k], b.fields[k]) for k in a.fields)
    link = calibrate(rank)
    gathered = [None] * world
    dist.all_gather_object(gathered, times, group=host_group())
    if rank != 0:
        return None
    med = {
        k: statistics.median(max(g[k][i] for g in gathered) for i in range(opts["repeats"]))
        for k in keys
    }
    return {"median_s": med, "link": link, "tokens": sum(lengths)}


def calibrate(rank: int) -> dict[str, float]:
    """Point-to-point latency and bandwidth between ranks 0 and 1, the bandwidth of four pairs
    at once (what the host moves together) and one rank's packing copy rate.

    Which ranks call: every rank of the world (ranks >= 8 only take part in barriers)."""
    import torch
    import torch.distributed as dist

    from megatron_earl.dispatch.execute import exchange_p2p

    world = dist.get_world_size()

    def pingpong(nbytes: int, pairs: int, reps: int) -> float:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        peer = rank ^ 1
        active = rank < 2 * pairs and peer < world
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if active:
                if rank % 2 == 0:
                    exchange_p2p({peer: buf}, {}, None)
                    exchange_p2p({}, {peer: buf}, None)
                else:
                    exchange_p2p({}, {peer: buf}, None)
                    exchange_p2p({peer: buf}, {}, None)
        dist.barrier()
        return (time.perf_counter() - t0) / (2 * reps)  # one way

    pingpong(1 << 16, 1, 3)  # warm-up: connections
    small, big = 8, 32 << 20
    t_small = min(pingpong(small, 1, 20) for _ in range(3))
    t_big = min(pingpong(big, 1, 2) for _ in range(3))
    pairs = max(1, min(4, world // 2))
    t_many = min(pingpong(big, pairs, 2) for _ in range(2))
    t_copy = t_slice = 0.0
    if rank == 0:  # alone (the others wait in the barrier)
        t_copy, t_slice = _host_rates(big)
    dist.barrier()
    return {
        "latency_us": t_small * 1e6,
        "p2p_gbps": big / max(t_big - t_small, 1e-9) / 1e9,
        "aggregate_gbps": pairs * big / max(t_many - t_small, 1e-9) / 1e9,
        "copy_gbps": big / max(t_copy, 1e-9) / 1e9,
        "slice_us": t_slice * 1e6,
        "cores": os.cpu_count() or 1,
        "pairs": pairs,
    }


def _host_rates(nbytes: int) -> tuple[float, float]:
    """Seconds to copy ``nbytes``, and per field slice the executor packs or unpacks (2,000
    one-token slices through ``_pack`` and ``_unpack``)."""
    import torch

    from megatron_earl.dispatch.batch import FieldSpec
    from megatron_earl.dispatch.execute import _layout, _pack, _Store, _unpack
    from megatron_earl.dispatch.route import Piece, Transfer

    src = torch.zeros(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    t_copy = (time.perf_counter() - t0) / 5
    specs = {"x": FieldSpec("x", torch.float32, True)}
    store, n = _Store(), 2000
    store.put(Piece(0, 0, n, ()), "x", torch.zeros(n))
    transfers = [Transfer(0, 1, Piece(0, i, i + 1, ("x",))) for i in range(n)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf = _pack(transfers, specs, store)
        _unpack(buf, _layout(transfers, specs), specs, _Store())
        best = min(best, time.perf_counter() - t0)
    return t_copy, best / (2 * n)


def local_model(link: dict[str, float]) -> NetworkModel:
    """The network model of the local processes: one "node" per process (its link the measured
    point-to-point bandwidth), the host's aggregate, latency, copy rate and per-slice cost as
    measured, the copies and slices of all processes shared over the host's cores."""
    return NetworkModel(
        gpus_per_node=1,
        nvlink_gbps=link["p2p_gbps"],  # unused with one rank per node
        nic_gbps=link["p2p_gbps"],
        latency_us=link["latency_us"],
        aggregate_gbps=link["aggregate_gbps"],
        copy_gbps=link["copy_gbps"],
        slice_us=link["slice_us"],
        cores=link["cores"],
    )


def _compare(m: dict, args: argparse.Namespace) -> dict:
    """The calibrated model's prediction of both paths' transfer (execute) times vs measured
    (the whole plan of the measured batch, planned here; sets the byte counts of ``m``)."""
    schema, model = agentic_schema(), local_model(m["link"])
    lengths = agentic_lengths(args.samples, args.max_len, args.seed)
    sources = _sources(lengths, args.world, args.samples_per_prompt)
    cfg = PlanConfig(route=RouteConfig(args.fanout, args.ranks_per_node))
    plan = plan_dispatch(sources, schema, Destination(_fill(args.layout, args.world)), cfg)
    assembling = model.assemble_seconds(plan.needs, schema)  # the same on both paths
    pred = {
        "decentralized": model.seconds(plan.stages, schema) + assembling,
        "centralized": model.seconds(centralized_stages(plan), schema) + assembling,
    }
    out = {}
    for path, p in pred.items():
        got = m["median_s"][f"{path}_execute"]
        out[path] = {"predicted_s": p, "measured_s": got, "error": (p - got) / got}
    out["ratio_predicted"] = pred["centralized"] / pred["decentralized"]
    m["decentralized"] = _busiest(plan.traffic())
    m["centralized"] = _busiest(plan.traffic(centralized_stages(plan)))
    m["bytes_total"] = sum(plan.traffic(centralized_stages(plan)[:1])["recv"])
    return out


# ---------------------------------------------------------------------- projection


def _timed(fn, repeats: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _root_planning(sources, schema, dest, cfg) -> object:
    """The centralized controller's planning: the balance, and every rank's needs (what it
    slices for whom) with the gather/scatter stages."""
    return centralized_stages(plan_dispatch(sources, schema, dest, cfg, rank=0, routed=False))


def _store_planning(sources, schema, dest, cfg) -> object:
    """A TransferQueue store's planning: the balance and every DP rank's micro-batches (no
    per-rank pieces: consumers pull whole samples)."""
    from megatron_earl.dispatch.plan import plan_micro_batches

    view = plan_dispatch(sources, schema, dest, cfg, rank=0, routed=False)
    lengths = dict(zip(view.samples.ids, view.samples.lengths))
    return [plan_micro_batches(a, lengths, 1, cfg) for a in view.assignment]


def project(args: argparse.Namespace, model: NetworkModel) -> list[dict]:
    """At each cluster size: plan the scaled batch (whole, for the model), time the planners in
    this process, model metadata and transfers of the three variants."""
    schema = agentic_schema()
    rows = []
    for gpus in [int(g) for g in args.proj_gpus.split(",") if g]:
        layout = _fill(args.proj_layout, gpus)
        num = args.proj_samples_per_gpu * gpus
        lengths = agentic_lengths(num, args.max_len, args.seed)
        sources = _sources(lengths, gpus, args.samples_per_prompt)
        cfg = PlanConfig(route=RouteConfig(args.fanout, model.gpus_per_node))
        dest = Destination(layout)
        gc.collect()  # planners timed first, on a small heap (whole plans come after)
        views = sorted({0, gpus // 2 + 1, gpus - 1} & set(range(gpus)))
        dec_plan = max(
            _timed(lambda r=r, a=(sources, schema, dest, cfg): plan_dispatch(*a, rank=r))[0]
            for r in views
        )
        cen_plan = _timed(lambda a=(sources, schema, dest, cfg): _root_planning(*a), 1)[0]
        # the store balances every sample (as every rank does) and answers every consumer
        store_plan = _timed(lambda a=(sources, schema, dest, cfg): _store_planning(*a), 1)[0]
        plan = plan_dispatch(sources, schema, dest, cfg)
        central = centralized_stages(plan)
        # TransferQueue: consumers pull whole samples (cp folded into tp), no relay
        pulled = ParallelLayout(tp=layout.tp * layout.cp, cp=1, pp=layout.pp, dp=layout.dp)
        direct = PlanConfig(route=RouteConfig("direct", model.gpus_per_node))
        tq = plan_dispatch(sources, schema, Destination(pulled), direct)
        per_rank_meta = 16 + 24 * -(-num // gpus)  # header + ids, lengths, groups (int64)
        meta = model.all_gather_seconds(gpus, 16) + model.all_gather_seconds(gpus, per_rank_meta)
        lat = model.latency_us * 1e-6
        tq_meta = 2 * gpus * lat + 2 * gpus * per_rank_meta / (model.nic_gbps * 1e9)
        dec_s = model.seconds(plan.stages, schema)
        cen_s = model.seconds(central, schema)
        tq_s = model.seconds(tq.stages, schema) + lat  # + a pull request's round trip
        dec_total = meta + dec_plan + dec_s
        cen_total = meta + cen_plan + cen_s
        tq_total = tq_meta + store_plan + tq_s
        rows.append(
            {
                "gpus": gpus,
                "layout": str(layout),
                "samples": num,
                "tokens": sum(lengths),
                "bytes": sum(plan.traffic(central[:1])["recv"]),
                "metadata_s": meta,
                "decentralized_planning_s": dec_plan,
                "decentralized_s": dec_s,
                "decentralized_total_s": dec_total,
                "centralized_planning_s": cen_plan,
                "centralized_s": cen_s,
                "centralized_total_s": cen_total,
                "transfer_queue_metadata_s": tq_meta,
                "transfer_queue_planning_s": store_plan,
                "transfer_queue_s": tq_s,
                "transfer_queue_total_s": tq_total,
                "ratio": cen_s / dec_s,
                "ratio_with_planning": cen_total / dec_total,
                "ratio_with_planning_baseline_balance_only": (meta + store_plan + cen_s)
                / dec_total,
                "ratio_with_planning_free_baseline": (meta + cen_s) / dec_total,
                "ratio_transfer_queue": tq_total / dec_total,
                "planning_share_of_transfer": dec_plan / dec_s,
                "busiest_bytes_decentralized": _busiest_total(plan.traffic()),
                "busiest_bytes_centralized": _busiest_total(plan.traffic(central)),
            }
        )
        del plan, central, tq  # a small heap for the next size's timed planners
    return rows


# ---------------------------------------------------------------------- entry


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
            "samples_per_prompt": args.samples_per_prompt,
            "max_len": args.max_len,
            "repeats": args.repeats,
            "fanout": args.fanout,
            "backend": "gloo (local processes)",
            "plan_cache": "off (every repeat plans from scratch)",
        },
        "network_model": model.__dict__,
    }
    if not args.no_measure:
        from megatron_earl.testing.distributed import run_distributed

        opts = {
            k: getattr(args, k)
            for k in (
                "layout",
                "samples",
                "samples_per_prompt",
                "max_len",
                "seed",
                "repeats",
                "ranks_per_node",
                "fanout",
            )
        }
        m = run_distributed(_bench_body, args.world, args=(opts,), timeout_s=3600)[0]
        m["model_vs_measured"] = _compare(m, args)
        med = m["median_s"]
        m["ratio_time"] = med["centralized_execute"] / med["decentralized_execute"]
        m["ratio_time_with_planning"] = med["centralized_total"] / med["decentralized_total"]
        dec, cen = m["decentralized"], m["centralized"]
        m["ratio_busiest_bytes"] = (cen["sent"] + cen["recv"]) / (dec["sent"] + dec["recv"])
        out["measured"] = m
    if not args.no_project:
        out["projection"] = project(args, model)
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    return out


def _print(out: dict) -> None:
    s = out["setting"]
    print(f"dispatch benchmark: {s['world']} gloo processes -> {s['layout']}, ", end="")
    print(f"{s['samples']} samples, context {s['max_len']}, {s['repeats']} repeats, no plan cache")
    m = out.get("measured")
    if m:
        med = m["median_s"]
        print(f"  batch: {m['tokens']} tokens, {m['bytes_total'] / 2**20:.1f} MiB")
        for v in PATHS:
            b = m[v]
            print(
                f"  {v:14s} total {med[v + '_total'] * 1e3:8.1f} ms (metadata + planning "
                f"{med[v + '_planning'] * 1e3:6.1f}, execute {med[v + '_execute'] * 1e3:8.1f})   "
                f"busiest rank {b['rank']}: sent {b['sent'] / 2**20:7.1f} MiB, "
                f"recv {b['recv'] / 2**20:7.1f} MiB"
            )
        print(
            f"  ratio centralized/decentralized: {m['ratio_time_with_planning']:.2f}x with every "
            f"cost, {m['ratio_time']:.2f}x execute only, busiest-rank bytes "
            f"{m['ratio_busiest_bytes']:.2f}x"
        )
        link = m["link"]
        print(
            f"  calibration: p2p {link['p2p_gbps']:.2f} GB/s, latency {link['latency_us']:.0f} us,"
            f" {link['pairs']} pairs together {link['aggregate_gbps']:.2f} GB/s, copy "
            f"{link['copy_gbps']:.2f} GB/s, {link['slice_us']:.1f} us per field slice, "
            f"{link['cores']} cores"
        )
        for v in PATHS:
            c = m["model_vs_measured"][v]
            print(
                f"  model {v:14s} predicted {c['predicted_s'] * 1e3:8.1f} ms, measured "
                f"{c['measured_s'] * 1e3:8.1f} ms (error {c['error'] * 100:+.0f}%)"
            )
    nm = out["network_model"]
    print(f"projection (modelled transfers, planning measured in this process): {nm}")
    head = ("GPUs", "layout", "samples", "GB", "plan ms", "dec ms", "cen ms", "TQ ms", "ratio")
    print("  {:>5} {:>14} {:>7} {:>6} {:>8} {:>8} {:>8} {:>8} {:>13}".format(*head))
    for r in out.get("projection", []):
        print(
            f"  {r['gpus']:5d} {r['layout']:>14} {r['samples']:7d} {r['bytes'] / 1e9:6.2f} "
            f"{r['decentralized_planning_s'] * 1e3:8.2f} {r['decentralized_total_s'] * 1e3:8.2f} "
            f"{r['centralized_total_s'] * 1e3:8.2f} {r['transfer_queue_total_s'] * 1e3:8.2f} "
            f"{r['ratio_with_planning']:6.1f}x ({r['ratio']:.1f}x transfer only)"
        )
