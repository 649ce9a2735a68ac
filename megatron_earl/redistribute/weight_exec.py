"""Executor of weight resharding plans: batched point-to-point isend/irecv on the world group.

    # layout A current:  chunks_a = build_model(...); pieces_a = shard_pieces(chunks_a)
    # use_layout(B):     chunks_b = build_model(...); pieces_b = shard_pieces(chunks_b)
    stats = reshard_weights(pieces_a, pieces_b, bucket_bytes=64 << 20)   # A -> B
    stats = reshard_weights(pieces_b, pieces_a, bucket_bytes=64 << 20)   # and back

The plan (``weight_plan.plan_weights``) is computed on every rank from piece metadata that is
all-gathered once, and cached (``plan_cache``): a repeated reshard of unchanged inputs costs one
all-reduce of a digest before its transfers. ``execute_plan`` then runs the local copies and,
round by round, packs each outgoing message into one byte buffer per peer, exchanges all
messages of the round with one ``batch_isend_irecv`` (``dispatch.execute.exchange_p2p``) and
unpacks into the destination parameters. A message that is a single contiguous box on one side
skips the buffer on that side (sent from / received into the parameter). Per round a rank
allocates at most its send and receive buffers of that round (<= ``bucket_bytes``), so no rank
ever materialises more of the model than the destination layout gives it. The traffic uses the
default (world) group, so it does not depend on either layout's process groups.

Groups and devices: the cache's all-reduce and the metadata all-gather run on the host twin of
``group`` (``parallel.groups.host_group``, gloo); the messages go over ``group`` itself (a device
group: NCCL on GPUs) in buffers on the compute device (``runtime.device()``), after
``parallel.groups.prepare_p2p``. Pieces on another device than the compute device -- rank 0's
whole host tensors for a push to remote SGLang engines (``orchestration.engines.sglang``) -- are
never sent from or received into directly: they are staged through device buffers (a documented
host/device boundary; at most ``bucket_bytes`` of device memory per round).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_earl import runtime
from megatron_earl.dispatch.execute import exchange_p2p
from megatron_earl.parallel.groups import prepare_p2p
from megatron_earl.redistribute.geometry import ShardPiece, region_shape, region_slices
from megatron_earl.redistribute.plan_cache import PLAN_CACHE, PlanCache, gather_and_plan
from megatron_earl.redistribute.weight_plan import WeightPlan, WeightTransfer


@dataclass(frozen=True)
class ReshardStats:
    """What one rank did in one reshard."""

    bytes_sent: int
    """Payload bytes this rank sent."""
    bytes_received: int
    """Payload bytes this rank received."""
    bytes_local: int
    """Bytes copied from this rank's own source pieces (no communication)."""
    num_rounds: int
    """Rounds of the plan (every rank walks all of them; idle rounds cost nothing)."""
    peak_buffer_bytes: int
    """Largest send + receive buffer bytes this rank held at once (<= the plan's bucket_bytes)."""
    plan_s: float
    """Seconds spent getting the plan: the cache's check, or all-gathering metadata and
    planning (0 when a plan was given)."""
    exec_s: float
    """Seconds spent copying and communicating."""
    plan_cached: bool = False
    """True when the plan came from the cache (no metadata all-gather, no planning)."""


def gather_plan(
    src_pieces: Sequence[ShardPiece],
    dst_pieces: Sequence[ShardPiece],
    bucket_bytes: int,
    group: dist.ProcessGroup | None = None,
    cache: PlanCache | None = PLAN_CACHE,
) -> WeightPlan:
    """The plan of a reshard: ``cache``'s when every rank's inputs are those it was made from
    (one all-reduce of a digest), else all-gathered metadata planned afresh (``plan_cache``).

    Collective: every rank of ``group`` (default: world) calls it, with its own pieces (possibly
    none); its collectives run on ``group``'s host twin. The returned plan is identical on every
    rank. ``cache=None``: no cache is read or written (all-gather and plan).
    """
    if cache is None:
        return gather_and_plan(src_pieces, dst_pieces, bucket_bytes, group)[0]
    return cache.plan(src_pieces, dst_pieces, bucket_bytes, group)[0]


@torch.no_grad()
def execute_plan(
    plan: WeightPlan,
    src_pieces: Sequence[ShardPiece],
    dst_pieces: Sequence[ShardPiece],
    group: dist.ProcessGroup | None = None,
) -> ReshardStats:
    """Run this rank's part of ``plan``: local copies, then the rounds of messages.

    Point to point: every rank of ``group`` (default: world; a device group) calls it with the
    same plan and the pieces the plan was made from; a rank only talks to the peers the plan
    pairs it with (after ``prepare_p2p(group)``, which every rank runs).
    """
    rank = dist.get_rank(group)
    if plan.world_size != dist.get_world_size(group):
        raise ValueError(
            f"plan for {plan.world_size} ranks executed on a group of {dist.get_world_size(group)}"
        )
    prepare_p2p(group)
    device = runtime.device()
    start = time.perf_counter()
    src_views = [p.region_view() for p in src_pieces]
    dst_views = [p.region_view() for p in dst_pieces]
    local_bytes = 0
    for t in plan.local:
        if t.dst_rank == rank:
            dst_views[t.dst_index][region_slices(t.dst_region)].copy_(
                src_views[t.src_index][region_slices(t.src_region)]
            )
            local_bytes += t.nbytes
    sent = received = peak = 0
    for transfers in plan.rounds:
        sends: dict[int, list[WeightTransfer]] = defaultdict(list)
        recvs: dict[int, list[WeightTransfer]] = defaultdict(list)
        for t in transfers:
            if t.src_rank == rank:
                sends[t.dst_rank].append(t)
            elif t.dst_rank == rank:
                recvs[t.src_rank].append(t)
        if not sends and not recvs:
            continue
        send_bufs: dict[int, torch.Tensor] = {}
        recv_bufs: dict[int, torch.Tensor] = {}
        unpack = []
        round_bytes = 0
        for peer, ts in sends.items():
            buf = _direct(ts, src_views, "src", device)
            if buf is None:
                buf = _buffer(ts, device)
                round_bytes += buf.numel()
                for t in ts:
                    _slot(buf, t, src_views[t.src_index].dtype).copy_(
                        src_views[t.src_index][region_slices(t.src_region)]
                    )
            sent += sum(t.nbytes for t in ts)
            send_bufs[peer] = buf
        for peer, ts in recvs.items():
            buf = _direct(ts, dst_views, "dst", device)
            if buf is None:
                buf = _buffer(ts, device)
                round_bytes += buf.numel()
                unpack.append((buf, ts))
            received += sum(t.nbytes for t in ts)
            recv_bufs[peer] = buf
        peak = max(peak, round_bytes)
        exchange_p2p(send_bufs, recv_bufs, group)
        for buf, ts in unpack:
            for t in ts:
                dst_views[t.dst_index][region_slices(t.dst_region)].copy_(
                    _slot(buf, t, dst_views[t.dst_index].dtype)
                )
    return ReshardStats(
        bytes_sent=sent,
        bytes_received=received,
        bytes_local=local_bytes,
        num_rounds=len(plan.rounds),
        peak_buffer_bytes=peak,
        plan_s=0.0,
        exec_s=time.perf_counter() - start,
    )


def reshard_weights(
    src_pieces: Sequence[ShardPiece],
    dst_pieces: Sequence[ShardPiece],
    *,
    bucket_bytes: int = 64 << 20,
    group: dist.ProcessGroup | None = None,
    cache: PlanCache | None = PLAN_CACHE,
) -> ReshardStats:
    """Copy every destination piece's region out of the source pieces: plan, then execute.

    Collective: every rank of ``group`` (default: world) calls it. ``src_pieces`` must have been
    taken (``geometry.shard_pieces``) while the source layout was current, ``dst_pieces`` while
    the destination layout was; the parallel state may be anything when this is called. The plan
    comes from ``cache`` when no rank's inputs changed since it was made (``plan_cache``: a
    repeated reshard costs one small all-reduce and the transfers); ``cache=None`` plans afresh.
    """
    start = time.perf_counter()
    if cache is None:
        plan, cached = gather_and_plan(src_pieces, dst_pieces, bucket_bytes, group)[0], False
    else:
        plan, cached = cache.plan(src_pieces, dst_pieces, bucket_bytes, group)
    plan_s = time.perf_counter() - start
    stats = execute_plan(plan, src_pieces, dst_pieces, group)
    return dataclasses.replace(stats, plan_s=plan_s, plan_cached=cached)


def _buffer(ts: list[WeightTransfer], device: torch.device) -> torch.Tensor:
    """A message buffer: the transfers at their offsets (no padding after the last one)."""
    last = ts[-1]
    return torch.empty(last.offset + last.nbytes, dtype=torch.uint8, device=device)


def _direct(
    ts: list[WeightTransfer], views: list[torch.Tensor], side: str, device: torch.device
) -> torch.Tensor | None:
    """The parameter memory itself as the message, when the message is one transfer whose box is
    contiguous on this side and lives on ``device`` (no staging copy, no buffer); else None. Each
    side decides alone: the message bytes are the same either way."""
    if len(ts) != 1:
        return None
    t = ts[0]
    index, region = (t.src_index, t.src_region) if side == "src" else (t.dst_index, t.dst_region)
    box = views[index][region_slices(region)]
    if not box.is_contiguous() or box.device != device:
        return None
    return box.reshape(-1).view(torch.uint8)


def _slot(buf: torch.Tensor, t: WeightTransfer, dtype: torch.dtype) -> torch.Tensor:
    """The transfer's box inside a message buffer, as a tensor of ``dtype`` and the box's shape."""
    return buf[t.offset : t.offset + t.nbytes].view(dtype).view(region_shape(t.region))
