"""Benchmark: layout switch and weight resharding between two layouts on N local processes.

    python scripts/bench_reshard.py --nproc 2 --src tp2 --dst pp2 [--layers 8 --hidden 512 ...]
    python scripts/bench_reshard.py --json          # one JSON line instead of the table

For a GPT model of the stated size (printed: parameters, bytes) every rank builds the model in the
source layout A, switches to the destination layout B (``use_layout``; first switch timed) and
builds it there. Then, for A -> B and for B -> A: the plan (``gather_plan``: metadata all-gather +
planning; first and cached), and the reshard (``execute_plan``; bytes sent and received per rank,
max and mean) alternating with the baseline: a plain all-gather of every rank's source parameters
to every rank (what a reshard without a plan does: every rank receives the whole source layout,
then slices), so both see the same background load. Last, B -> A -> B again (cached switches).
Times are the slowest rank's, best of ``--repeats``.

Runs through ``megatron_earl.testing.distributed.run_distributed`` (gloo on CPU; on a machine with
one GPU per process it would use NCCL). Model building is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from megatron_earl import runtime
from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.groups import host_group
from megatron_earl.parallel.layout import ParallelLayout


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local processes (world size)")
    p.add_argument("--src", default="tp2", help="source layout, e.g. tp2 or tp2pp2")
    p.add_argument("--dst", default="pp2", help="destination layout, e.g. pp2 or cp2dp2")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="query groups (GQA)")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tie", action="store_true", help="tie embeddings and output layer")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--bucket-mb", type=float, default=16.0, help="bound on buffers per round")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    return p.parse_args(argv)


def _timed(fn) -> tuple[float, Any]:
    """(seconds, result) of ``fn()`` between two world barriers (device world: on NCCL they
    also wait for queued device work). Every rank calls it."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    value = fn()
    dist.barrier()
    return time.perf_counter() - start, value


def _allgather_all(pieces, bucket_bytes: int):
    """A callable that moves every rank's source parameters to every rank by all-gather (in
    chunks of ``bucket_bytes`` of output), and the bytes each call receives on this rank.

    Collective: every rank of the world calls it (and the returned callable)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    mine = torch.cat([p.local.detach().reshape(-1).view(torch.uint8) for p in pieces])
    sizes = [None] * world
    dist.all_gather_object(sizes, mine.numel(), group=host_group())
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=mine.device)
    padded[: mine.numel()] = mine
    step = max(1, bucket_bytes // world)

    def run() -> None:
        for start in range(0, longest, step):
            chunk = padded[start : start + step]
            dist.all_gather([torch.empty_like(chunk) for _ in range(world)], chunk)

    return run, sum(sizes) - mine.numel()


def _body(model: ModelConfig, src: ParallelLayout, dst: ParallelLayout, bucket: int, repeats: int):
    """Every rank: the measurements of one rank."""
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import shard_pieces
    from megatron_earl.redistribute.weight_exec import execute_plan, gather_plan

    out: dict[str, Any] = {}
    out["init_s"], _ = _timed(lambda: use_layout(src))
    runtime.seed(1)
    pieces_a = shard_pieces(build_model(model, vpp=src.vpp))
    out["switch_first_s"], _ = _timed(lambda: use_layout(dst))
    pieces_b = shard_pieces(build_model(model, vpp=dst.vpp))
    for name, s, d in (("there", pieces_a, pieces_b), ("back", pieces_b, pieces_a)):
        out[f"{name}_plan_s"], plan = _timed(lambda s=s, d=d: gather_plan(s, d, bucket))
        out[f"{name}_plan_cached_s"], _ = _timed(lambda s=s, d=d: gather_plan(s, d, bucket))
        gather, out[f"{name}_allgather_received"] = _allgather_all(s, bucket)
        # Alternate the two so that both see the same background load; best of each.
        runs, gathers = [], []
        for _ in range(repeats):
            runs.append(_timed(lambda p=plan, s=s, d=d: execute_plan(p, s, d)))
            gathers.append(_timed(gather)[0])
        stats = runs[-1][1]
        out[f"{name}_exec_s"] = min(t for t, _ in runs)
        out[f"{name}_allgather_s"] = min(gathers)
        out[f"{name}_sent"] = stats.bytes_sent
        out[f"{name}_received"] = stats.bytes_received
        out[f"{name}_local"] = stats.bytes_local
        out[f"{name}_rounds"] = stats.num_rounds
        out[f"{name}_peak_buffer"] = stats.peak_buffer_bytes
    cached = [_timed(lambda: use_layout(src))[0], _timed(lambda: use_layout(dst))[0]]
    out["switch_cached_s"] = sum(cached) / len(cached)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark on ``args.nproc`` processes; the setting and the figures."""
    from megatron_earl.testing.distributed import run_distributed

    model = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        vocab_size=args.vocab,
        add_qkv_bias=True,
        tie_embeddings=args.tie,
        params_dtype=args.dtype,
    )
    src, dst = ParallelLayout.parse(args.src), ParallelLayout.parse(args.dst)
    for layout in (src, dst):
        layout.validate(args.nproc, model)
    bucket = int(args.bucket_mb * (1 << 20))
    ranks = run_distributed(
        _body, args.nproc, args=(model, src, dst, bucket, args.repeats), timeout_s=args.timeout
    )
    num_params = model.num_parameters()
    res: dict[str, Any] = {
        "nproc": args.nproc,
        "src": str(src),
        "dst": str(dst),
        "params": num_params,
        "param_bytes": num_params * model.torch_dtype.itemsize,
        "dtype": args.dtype,
        "bucket_bytes": bucket,
        "backend": runtime.policy().device_backend,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // args.nproc),
        "repeats": args.repeats,
    }
    for key in ("init_s", "switch_first_s", "switch_cached_s"):
        res[key] = max(r[key] for r in ranks)
    for name in ("there", "back"):
        for key in ("plan_s", "plan_cached_s", "exec_s", "allgather_s"):
            res[f"{name}_{key}"] = max(r[f"{name}_{key}"] for r in ranks)
        res[f"{name}_rounds"] = ranks[0][f"{name}_rounds"]
        res[f"{name}_peak_buffer_max"] = max(r[f"{name}_peak_buffer"] for r in ranks)
        for what in ("sent", "received", "local", "allgather_received"):
            values = [r[f"{name}_{what}"] for r in ranks]
            res[f"{name}_{what}_max"] = max(values)
            res[f"{name}_{what}_mean"] = sum(values) / len(values)
    return res


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(r: dict[str, Any]) -> str:
    lines = [
        f"setting: {r['nproc']} processes ({r['backend']}, {r['threads_per_rank']} threads/rank), "
        f"{r['src']} <-> {r['dst']}, bucket {_mb(r['bucket_bytes'])}, best of {r['repeats']}",
        f"model:   {r['params'] / 1e6:.1f} M params, {_mb(r['param_bytes'])} ({r['dtype']})",
        f"layout switch: first {r['switch_first_s'] * 1e3:.1f} ms, cached "
        f"{r['switch_cached_s'] * 1e3:.1f} ms (initial init {r['init_s'] * 1e3:.1f} ms)",
    ]
    for name, a, b in (("there", r["src"], r["dst"]), ("back", r["dst"], r["src"])):
        exec_s, gather_s = r[f"{name}_exec_s"], r[f"{name}_allgather_s"]
        lines += [
            f"reshard {a} -> {b}: {exec_s * 1e3:.1f} ms "
            f"(+ plan {r[f'{name}_plan_s'] * 1e3:.1f} ms, cached "
            f"{r[f'{name}_plan_cached_s'] * 1e3:.1f} ms; {r[f'{name}_rounds']} rounds, "
            f"peak buffers {_mb(r[f'{name}_peak_buffer_max'])})",
            f"  bytes per rank: sent max {_mb(r[f'{name}_sent_max'])} mean "
            f"{_mb(r[f'{name}_sent_mean'])}; received max {_mb(r[f'{name}_received_max'])} mean "
            f"{_mb(r[f'{name}_received_mean'])}; copied locally mean "
            f"{_mb(r[f'{name}_local_mean'])}",
            f"  vs plain all-gather of every {a} parameter to every rank: {gather_s * 1e3:.1f} ms, "
            f"received per rank {_mb(r[f'{name}_allgather_received_max'])} "
            f"(all-gather / reshard time: {gather_s / max(exec_s, 1e-9):.2f})",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    result = measure(args)
    print(json.dumps(result) if args.json else report(result), flush=True)
    return result
