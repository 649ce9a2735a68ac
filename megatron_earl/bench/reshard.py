"""Benchmark: layout switch and weight resharding between two layouts on N local processes, and
the same reshards side by side with megatron-core's own resharder.

    python scripts/bench_reshard.py --nproc 2 --src tp2 --dst pp2 [--layers 8 --hidden 512 ...]
    python scripts/bench_reshard.py --json          # one JSON line instead of the table
    megatron-earl bench reshard --against megatron-core --nproc 4 [--pairs A:B,... --rounds 9]

For a GPT model of the stated size (printed: parameters, bytes) every rank builds the model in the
source layout A, switches to the destination layout B (``use_layout``; first switch timed) and
builds it there. Then, for A -> B and for B -> A: the plan (``gather_plan``: metadata
all-gather + planning the first time; cached: the cache's all-reduce check), and the reshard
(``execute_plan``; bytes sent and received per rank, max and mean) alternating with the
baseline: a plain all-gather of every rank's source parameters to every rank (what a reshard
without a plan does: every rank receives the whole source layout, then slices), so both see the
same background load. Last, B -> A -> B again (cached switches). Times are the slowest rank's,
best of ``--repeats``.

``--against megatron-core``: for every pair A:B (default: six directed pairs per world size,
``DEFAULT_PAIRS``) both libraries reshard the *same* models in the *same* processes:
megatron-core 0.16.1's ``megatron.core.resharding.swap_model_weights`` with its gloo copy service,
and ours (``reshard_weights``). Every layout's model is built once and loaded with the same
deterministic reference weights; before every call the destination is poisoned with NaN, after it
the destination must equal its directly loaded weights bitwise (so the two libraries' results are
bitwise equal too). Per round and pair each library makes a *first call* (its plan cache emptied:
ours ``PLAN_CACHE.clear()``, megatron-core's plan attribute dropped from the target model) and a
*repeated call* (plan cached); the libraries alternate which goes first from round to round, and
every figure is the median over ``--rounds`` of the slowest rank. Every cost is inside the timed
calls: megatron-core's metadata extraction, all-gathers, planning on rank 0, broadcast, slicing
copies and write-backs; our cache check, metadata all-gather and planning (first call), packing and
unpacking. Our first call also adds ``shard_pieces`` of both models (timed when the models are
built: pieces are taken once per model, while its layout is current), the counterpart of
megatron-core's per-call parameter metadata. One untimed warm-up call per library and pair
comes first (megatron-core's copy service creates its gloo group there). VPP layouts are refused:
megatron-core reshards one model chunk.

Runs through ``megatron_earl.testing.distributed.run_distributed`` (gloo on CPU; on a machine with
one GPU per process it would use NCCL). Model building is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zlib
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
    p.add_argument(
        "--against",
        choices=["megatron-core"],
        help="compare with megatron-core's resharder on --pairs (first and repeated calls)",
    )
    p.add_argument("--pairs", help="with --against: A:B,... (default: DEFAULT_PAIRS[nproc])")
    p.add_argument("--rounds", type=int, default=9, help="with --against: interleaved rounds")
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
    from megatron_earl.redistribute.plan_cache import PLAN_CACHE
    from megatron_earl.redistribute.weight_exec import execute_plan, gather_plan

    out: dict[str, Any] = {}
    out["init_s"], _ = _timed(lambda: use_layout(src))
    runtime.seed(1)
    pieces_a = shard_pieces(build_model(model, vpp=src.vpp))
    out["switch_first_s"], _ = _timed(lambda: use_layout(dst))
    pieces_b = shard_pieces(build_model(model, vpp=dst.vpp))
    PLAN_CACHE.clear()
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


def _model(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark on ``args.nproc`` processes; the setting and the figures."""
    from megatron_earl.testing.distributed import run_distributed

    model = _model(args)
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


DEFAULT_PAIRS = {
    2: "dp2:tp2,tp2:dp2,tp2:pp2,pp2:tp2,cp2:pp2,pp2:cp2",
    4: "tp2pp2:cp2dp2,cp2dp2:tp2pp2,tp2cp2:pp2dp2,pp2dp2:tp2cp2,dp4:tp2pp2,tp2pp2:dp4",
}
"""``--against`` pairs per world size when ``--pairs`` is not given (directed: A:B is A -> B)."""


def _reference(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The reference global tensor of a key: random, the same on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def _against_body(
    model: ModelConfig, pairs: list[tuple[ParallelLayout, ParallelLayout]], bucket: int, rounds: int
) -> dict[str, Any]:
    """Every rank: both libraries on every pair; per pair the timings of every round (this
    rank's, between barriers) and the bitwise mismatches seen."""
    from megatron.core.resharding import get_or_create_service, swap_model_weights

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.patches.cpu_redirect import when_applied
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces
    from megatron_earl.redistribute.plan_cache import PLAN_CACHE
    from megatron_earl.redistribute.weight_exec import reshard_weights

    built: dict[ParallelLayout, tuple] = {}
    for layout in dict.fromkeys(layout for pair in pairs for layout in pair):
        use_layout(layout)
        runtime.seed(1)
        chunks = build_model(model, vpp=layout.vpp)
        pieces_s, pieces = _timed(lambda chunks=chunks: shard_pieces(chunks))
        load_full_state_dict(chunks, {p.key: _reference(p.key, p.global_shape) for p in pieces})
        built[layout] = (chunks, pieces, [p.local.clone() for p in pieces], pieces_s)
    # The gloo copy service asks for a CUDA stream when made; on the CPU there is none, and its
    # run() skips waiting for the stream when it is None.
    with when_applied():
        service = get_or_create_service("gloo")
    if not torch.cuda.is_available():
        service._copy_stream = None

    def call(lib: str, first: bool, src, dst) -> tuple[float, float]:
        """(seconds, our plan seconds) of one reshard src -> dst; poisons and checks dst."""
        with torch.no_grad():
            for p in dst[1]:
                p.local.fill_(float("nan"))
        if lib == "ours":
            if first:
                PLAN_CACHE.clear()
            seconds, stats = _timed(lambda: reshard_weights(src[1], dst[1], bucket_bytes=bucket))
            assert stats.plan_cached != first, (lib, first, stats)
            plan_s = stats.plan_s
            moved[:] = [stats.bytes_sent, stats.bytes_received, stats.bytes_local]
        else:
            if first:
                dst[0][0].__dict__.pop("_cached_reshard_plan", None)
            seconds, _ = _timed(lambda: swap_model_weights(src[0], dst[0], service))
            plan_s = 0.0
        bad = [
            p.param_name
            for p, w in zip(dst[1], dst[2], strict=True)
            if not torch.equal(p.local.view(torch.uint8), w.view(torch.uint8))
        ]
        if bad:
            mismatches.append(f"{lib} {'first' if first else 'repeated'}: {bad[:3]}")
        return seconds, plan_s

    out: dict[str, Any] = {"pieces_s": {str(k): v[3] for k, v in built.items()}, "pairs": {}}
    out["limits"] = machine_limits()
    moved = [0, 0, 0]
    for a, b in pairs:
        mismatches: list[str] = []
        src, dst = built[a], built[b]
        for lib in ("megatron-core", "ours"):  # warm-up, untimed
            call(lib, True, src, dst)
        times: dict[str, list[float]] = {}
        for r in range(rounds):
            order = ("megatron-core", "ours") if r % 2 == 0 else ("ours", "megatron-core")
            for lib in order:
                for first in (True, False):
                    seconds, plan_s = call(lib, first, src, dst)
                    kind = "first" if first else "repeated"
                    times.setdefault(f"{lib}_{kind}_s", []).append(seconds)
                    if lib == "ours":
                        times.setdefault(f"ours_{kind}_plan_s", []).append(plan_s)
        out["pairs"][f"{a}:{b}"] = {"times": times, "mismatches": mismatches, "moved": moved[:]}
    return out


LIMIT_BYTES = 64 << 20
"""Buffer of the machine-limit probes (large enough that per-call costs vanish)."""


def machine_limits(rounds: int = 5) -> dict[str, float]:
    """This machine's ceilings for a reshard's two kinds of work, on this rank: ``memcpy_Bps``, a
    copy of ``LIMIT_BYTES`` between two host buffers (one thread, as the executor's local
    copies); ``loopback_Bps``, a gloo send of ``LIMIT_BYTES`` from rank 0 to rank 1 of the world
    (what a transfer between two ranks of this host can reach; every rank but 0 and 1 reports
    rank 1's). Best of ``rounds``. Which ranks call: every rank of the world."""
    import torch.distributed as dist

    a = torch.ones(LIMIT_BYTES, dtype=torch.uint8)
    b = torch.empty_like(a)
    copy_s = []
    with _threads(1):
        for _ in range(rounds):
            start = time.perf_counter()
            b.copy_(a)
            copy_s.append(time.perf_counter() - start)
    rank = dist.get_rank()
    send_s = [0.0]
    for _ in range(rounds + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(a, dst=1)
        elif rank == 1:
            dist.recv(b, src=0)
            send_s.append(time.perf_counter() - start)
    best = torch.tensor([min(send_s[2:]) if rank == 1 else 0.0], dtype=torch.float64)
    dist.broadcast(best, src=1)
    return {"memcpy_Bps": LIMIT_BYTES / min(copy_s), "loopback_Bps": LIMIT_BYTES / float(best)}


class _threads:
    """torch's intra-op threads set to ``n`` inside the block."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


def measure_against(args: argparse.Namespace) -> dict[str, Any]:
    """``--against megatron-core`` on ``args.nproc`` processes: the setting and, per pair,
    medians over rounds of the slowest rank."""
    from megatron_earl.testing.distributed import run_distributed

    model = _model(args)
    text = args.pairs or DEFAULT_PAIRS.get(args.nproc)
    if not text:
        raise SystemExit(
            f"--pairs is needed for --nproc {args.nproc} "
            f"(defaults exist for {sorted(DEFAULT_PAIRS)})"
        )
    pairs, labels = [], []
    for item in text.split(","):
        names = item.split(":")
        if len(names) != 2:
            raise SystemExit(f"--pairs item {item!r} is not A:B (e.g. tp2:pp2)")
        pair = tuple(ParallelLayout.parse(n) for n in names)
        labels.append(item)
        for layout in pair:
            layout.validate(args.nproc, model)
            if layout.vpp:
                raise SystemExit(
                    f"{layout}: megatron-core's resharder takes one model chunk (no vpp)"
                )
        pairs.append(pair)
    bucket = int(args.bucket_mb * (1 << 20))
    load_before = os.getloadavg()
    ranks = run_distributed(
        _against_body,
        args.nproc,
        args=(model, pairs, bucket, args.rounds),
        timeout_s=args.timeout,
    )
    num_params = model.num_parameters()
    res: dict[str, Any] = {
        "against": args.against,
        "nproc": args.nproc,
        "params": num_params,
        "param_bytes": num_params * model.torch_dtype.itemsize,
        "model": {
            k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "groups", "vocab")
        },
        "dtype": args.dtype,
        "tie": args.tie,
        "bucket_bytes": bucket,
        "rounds": args.rounds,
        "backend": runtime.policy().device_backend,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // args.nproc),
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "pairs": {},
    }
    res["limits"] = {k: min(r["limits"][k] for r in ranks) for k in ("memcpy_Bps", "loopback_Bps")}
    pieces_s = {k: max(r["pieces_s"][k] for r in ranks) for k in ranks[0]["pieces_s"]}
    for (a, b), label, name in zip(pairs, labels, ranks[0]["pairs"], strict=True):
        # Per round the slowest rank, then the median over rounds.
        per_round = {
            key: [max(vals) for vals in zip(*(r["pairs"][name]["times"][key] for r in ranks))]
            for key in ranks[0]["pairs"][name]["times"]
        }
        row = {key: statistics.median(vals) for key, vals in per_round.items()}
        row["ours_pieces_s"] = pieces_s[str(a)] + pieces_s[str(b)]
        row["ours_first_total_s"] = row["ours_first_s"] + row["ours_pieces_s"]
        row["ratio_first"] = row["megatron-core_first_s"] / row["ours_first_total_s"]
        row["ratio_repeated"] = row["megatron-core_repeated_s"] / row["ours_repeated_s"]
        row["mismatches"] = sorted({m for r in ranks for m in r["pairs"][name]["mismatches"]})
        # The busiest rank's bytes in our repeated call, at the ceilings: sent or received over
        # gloo at loopback speed, copied locally at memcpy speed (one after the other).
        sent, received, local = max((r["pairs"][name]["moved"] for r in ranks), key=sum)
        lim = res["limits"]
        row["moved_bytes"] = [sent, received, local]
        row["floor_s"] = max(sent, received) / lim["loopback_Bps"] + local / lim["memcpy_Bps"]
        row["share_of_limit"] = row["floor_s"] / row["ours_repeated_s"]
        res["pairs"][label.replace(":", " -> ")] = row
    return res


def report_against(r: dict[str, Any]) -> str:
    ms = 1e3
    m = r["model"]
    lines = [
        f"setting: {r['nproc']} processes ({r['backend']}, {r['threads_per_rank']} threads/rank, "
        f"{r['cpu_count']} cores), bucket {_mb(r['bucket_bytes'])}, medians of {r['rounds']} "
        "interleaved rounds of the slowest rank",
        f"model:   {r['params'] / 1e6:.2f} M params, {_mb(r['param_bytes'])} ({r['dtype']}"
        f"{', tied' if r['tie'] else ''}): {m['layers']} layers, hidden {m['hidden']}, ffn "
        f"{m['ffn']}, {m['heads']} heads / {m['groups']} groups, vocab {m['vocab']}",
        "load:    average (1, 5, 15 min) "
        + " -> ".join(
            "(" + ", ".join(f"{x:.1f}" for x in la) + ")"
            for la in (r["loadavg_before"], r["loadavg_after"])
        )
        + " before -> after",
        "against: megatron-core (megatron.core.resharding.swap_model_weights, gloo copy service)",
        f"limits:  memory copy {r['limits']['memcpy_Bps'] / 1e9:.2f} GB/s (one thread), gloo "
        f"loopback {r['limits']['loopback_Bps'] / 1e9:.2f} GB/s (rank 0 -> 1, "
        f"{_mb(LIMIT_BYTES)}), measured on this machine now",
        "",
        f"{'pair':<18}{'first call: mcore':>18}{'ours':>10}{'ratio':>7}"
        f"{'repeated: mcore':>18}{'ours':>10}{'(check)':>10}{'ratio':>7}{'floor':>10}"
        f"{'of limit':>9}  bitwise",
    ]
    for name, row in r["pairs"].items():
        lines.append(
            f"{name:<18}{row['megatron-core_first_s'] * ms:>15.1f} ms"
            f"{row['ours_first_total_s'] * ms:>7.1f} ms{row['ratio_first']:>7.2f}"
            f"{row['megatron-core_repeated_s'] * ms:>15.1f} ms"
            f"{row['ours_repeated_s'] * ms:>7.1f} ms{row['ours_repeated_plan_s'] * ms:>7.2f} ms"
            f"{row['ratio_repeated']:>7.2f}{row['floor_s'] * ms:>7.1f} ms"
            f"{row['share_of_limit']:>8.0%}  "
            + ("equal" if not row["mismatches"] else "DIFFERS: " + "; ".join(row["mismatches"]))
        )
    lines += [
        "",
        "ratio = megatron-core / ours. ours first = shard_pieces of both models + cache check + "
        "metadata all-gather + plan + transfers; (check) = our repeated call's plan lookup "
        "(one all-reduce of a digest). bitwise: both libraries' results against the directly "
        "loaded weights, every call. floor = the busiest rank's bytes of our repeated call at the "
        "limits (sent or received at loopback speed, local copies at memory-copy speed); of "
        "limit = floor / ours repeated: how close the reshard runs to this machine's ceiling.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Console entry (``megatron-earl bench reshard``): print the report; exit status 0."""
    args = _parse(argv)
    if args.against:
        result = measure_against(args)
        print(json.dumps(result) if args.json else report_against(result), flush=True)
    else:
        result = measure(args)
        print(json.dumps(result) if args.json else report(result), flush=True)
    return 0
