"""Pure planner for moving model weights from one parallel layout to another.

Input: for every rank, the metadata of the shard pieces it holds in the source layout and of the
pieces it must fill in the destination layout (``PieceMeta``: global key, global shape, region,
element size; built from ``geometry.shard_pieces`` and all-gathered once). Output: a
``WeightPlan`` that is a pure function of that metadata, so every rank computes the same plan and
executes its own part of it (``weight_exec``).

How the plan is made:

1. Sources are grouped by key and region. Ranks holding the same region are replicas (DP, CP, and
   the tied output layer of the last pipeline stage); distinct regions of one key must be disjoint
   (they are in every Megatron layout), so every destination element has exactly one source region.
2. For each destination piece (keys sorted, then regions, then ranks) and each source region that
   intersects it, one replica is chosen: the destination rank itself if it holds one (a local copy,
   nothing sent), otherwise the replica whose rank has been assigned the fewest bytes to send so far
   (ties go to the next rank after the destination, which spreads equal loads round-robin).
3. Remote transfers larger than half the bucket are split into boxes that fit (whole rows
   first), so that a round can carry a send and a receive of the same rank at full size.
4. Remote transfers are packed into rounds, first-fit by decreasing size, so that in every round
   each rank's send plus receive bytes (each transfer padded to ``ALIGN``) stay within
   ``bucket_bytes``: the executor allocates at most those buffers, so ``bucket_bytes`` bounds the
   peak extra memory of the reshard. All transfers from one rank to another in one round travel as
   one message; ``WeightTransfer.offset`` is their byte offset inside it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_earl.redistribute.geometry import Region, intersect, region_numel, relative

ALIGN = 16
"""Byte alignment of every transfer inside a message (lets any dtype view the byte buffer)."""


class WeightPlanError(ValueError):
    """The source and destination layouts do not describe the same model."""


@dataclass(frozen=True)
class PieceMeta:
    """Picklable description of one shard piece (``geometry.ShardPiece`` without tensors)."""

    key: str
    """Global tensor key."""
    global_shape: tuple[int, ...]
    """Shape of the whole global tensor."""
    region: Region
    """[start, stop) per dimension of the global tensor held by the piece."""
    itemsize: int
    """Bytes per element."""

    def __post_init__(self) -> None:
        if len(self.region) != len(self.global_shape) or any(
            not 0 <= a < b <= n for (a, b), n in zip(self.region, self.global_shape)
        ):
            raise WeightPlanError(
                f"{self.key}: region {self.region} is not a non-empty box of {self.global_shape}"
            )
        if self.itemsize < 1:
            raise WeightPlanError(f"{self.key}: itemsize {self.itemsize} must be >= 1")

    @property
    def nbytes(self) -> int:
        return region_numel(self.region) * self.itemsize


@dataclass(frozen=True)
class WeightTransfer:
    """Copy of one box of a global tensor from a source piece to a destination piece."""

    src_rank: int
    """Rank holding the source piece."""
    dst_rank: int
    """Rank holding the destination piece (== src_rank: a local copy)."""
    key: str
    """Global tensor key."""
    src_index: int
    """Index of the source piece in the source rank's piece list."""
    dst_index: int
    """Index of the destination piece in the destination rank's piece list."""
    region: Region
    """The box, in global coordinates."""
    src_region: Region
    """The box relative to the source piece's region."""
    dst_region: Region
    """The box relative to the destination piece's region."""
    nbytes: int
    """Payload bytes."""
    offset: int = 0
    """Byte offset inside the (round, src_rank, dst_rank) message; 0 for local copies."""

    @property
    def padded_nbytes(self) -> int:
        return _align(self.nbytes)


@dataclass(frozen=True)
class WeightPlan:
    """Every copy of a reshard: local copies and rounds of point-to-point messages."""

    world_size: int
    """Ranks taking part (ranks of the group the plan is executed on)."""
    bucket_bytes: int
    """Bound on each rank's send + receive buffer bytes in one round."""
    local: tuple[WeightTransfer, ...]
    """Copies whose source and destination are the same rank (no communication)."""
    rounds: tuple[tuple[WeightTransfer, ...], ...]
    """Remote transfers, one tuple per round, ordered by (src_rank, dst_rank, offset)."""

    def bytes_sent(self, rank: int) -> int:
        return sum(t.nbytes for r in self.rounds for t in r if t.src_rank == rank)

    def bytes_received(self, rank: int) -> int:
        return sum(t.nbytes for r in self.rounds for t in r if t.dst_rank == rank)

    def bytes_local(self, rank: int) -> int:
        return sum(t.nbytes for t in self.local if t.dst_rank == rank)

    def round_buffer_bytes(self, round_index: int, rank: int) -> int:
        """Send + receive buffer bytes ``rank`` allocates in a round (<= bucket_bytes)."""
        return sum(
            t.padded_nbytes for t in self.rounds[round_index] if rank in (t.src_rank, t.dst_rank)
        )


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_box(box: Region, itemsize: int, max_bytes: int) -> list[Region]:
    """Split ``box`` into boxes of at most ``max_bytes`` each: runs of whole rows along the first
    dimension when a row fits, otherwise one index of the first dimension at a time, recursively."""
    if max_bytes < itemsize:
        raise WeightPlanError(f"max_bytes {max_bytes} is smaller than one element ({itemsize})")
    if region_numel(box) * itemsize <= max_bytes:
        return [box]
    (lo, hi), rest = box[0], box[1:]
    row_bytes = region_numel(rest) * itemsize
    if row_bytes <= max_bytes:
        step = max_bytes // row_bytes
        return [((a, min(a + step, hi)), *rest) for a in range(lo, hi, step)]
    subs = split_box(rest, itemsize, max_bytes)
    return [((a, a + 1), *sub) for a in range(lo, hi) for sub in subs]


def _source_regions(
    src: Sequence[Sequence[PieceMeta]],
) -> dict[str, list[tuple[Region, list[tuple[int, int]]]]]:
    """key -> [(region, [(rank, piece index), ...] replicas)], regions sorted; validated."""
    holders: dict[str, dict[Region, list[tuple[int, int]]]] = defaultdict(dict)
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for rank, metas in enumerate(src):
        for index, m in enumerate(metas):
            seen = shapes.setdefault(m.key, (m.global_shape, m.itemsize))
            if seen != (m.global_shape, m.itemsize):
                raise WeightPlanError(
                    f"{m.key}: source ranks disagree on (global shape, itemsize): {seen} vs "
                    f"{(m.global_shape, m.itemsize)} on rank {rank}"
                )
            holders[m.key].setdefault(m.region, []).append((rank, index))
    out = {}
    for key, by_region in holders.items():
        regions = sorted(by_region)
        for i, a in enumerate(regions):
            for b in regions[i + 1 :]:
                if intersect(a, b) is not None:
                    raise WeightPlanError(
                        f"{key}: source regions {a} and {b} overlap without being equal; "
                        "a layout's shards of one tensor must be disjoint or identical"
                    )
        out[key] = [(r, by_region[r]) for r in regions]
    return out


def plan_weights(
    src: Sequence[Sequence[PieceMeta]],
    dst: Sequence[Sequence[PieceMeta]],
    bucket_bytes: int,
) -> WeightPlan:
    """Plan copying every destination piece from the source pieces (pure; same on every rank).

    ``src[r]`` / ``dst[r]``: the pieces rank r holds in the source / destination layout, in the
    order the executor will index them.
    """
    if len(src) != len(dst):
        raise WeightPlanError(f"{len(src)} source ranks but {len(dst)} destination ranks")
    if bucket_bytes < ALIGN:
        raise WeightPlanError(f"bucket_bytes ({bucket_bytes}) must be >= {ALIGN}")
    world = len(src)
    sources = _source_regions(src)
    # Half a bucket per transfer, so a rank can send one and receive one in the same round.
    max_chunk = max(ALIGN, bucket_bytes // (2 * ALIGN) * ALIGN)
    load = [0] * world
    local: list[WeightTransfer] = []
    remote: list[WeightTransfer] = []
    order = sorted(
        (
            (m.key, m.region, rank, index)
            for rank, metas in enumerate(dst)
            for index, m in enumerate(metas)
        ),
    )
    for key, region, dst_rank, dst_index in order:
        m = dst[dst_rank][dst_index]
        if key not in sources:
            raise WeightPlanError(
                f"destination tensor {key!r} (rank {dst_rank}) is held by no source rank"
            )
        first_rank, first_index = sources[key][0][1][0]
        ref = src[first_rank][first_index]
        shape, itemsize = ref.global_shape, ref.itemsize
        if (m.global_shape, m.itemsize) != (shape, itemsize):
            raise WeightPlanError(
                f"{key}: destination (global shape, itemsize) {(m.global_shape, m.itemsize)} on "
                f"rank {dst_rank} != source {(shape, itemsize)}"
            )
        covered = 0
        for src_region, replicas in sources[key]:
            box = intersect(region, src_region)
            if box is None:
                continue
            nbytes = region_numel(box) * itemsize
            covered += region_numel(box)
            mine = [rep for rep in replicas if rep[0] == dst_rank]
            if mine:
                src_rank, src_index = mine[0]
                local.append(
                    WeightTransfer(
                        src_rank,
                        dst_rank,
                        key,
                        src_index,
                        dst_index,
                        box,
                        relative(box, src_region),
                        relative(box, region),
                        nbytes,
                    )
                )
                continue
            src_rank, src_index = min(
                replicas, key=lambda rep: (load[rep[0]], (rep[0] - dst_rank) % world)
            )
            load[src_rank] += nbytes
            for sub in split_box(box, itemsize, max_chunk):
                remote.append(
                    WeightTransfer(
                        src_rank,
                        dst_rank,
                        key,
                        src_index,
                        dst_index,
                        sub,
                        relative(sub, src_region),
                        relative(sub, region),
                        region_numel(sub) * itemsize,
                    )
                )
        if covered != region_numel(region):
            raise WeightPlanError(
                f"{key}: destination region {region} on rank {dst_rank} is only covered for "
                f"{covered} of {region_numel(region)} elements by the source layout"
            )
    return WeightPlan(world, bucket_bytes, tuple(local), _pack_rounds(remote, world, bucket_bytes))


def _pack_rounds(
    transfers: list[WeightTransfer], world: int, bucket_bytes: int
) -> tuple[tuple[WeightTransfer, ...], ...]:
    """First-fit decreasing: each rank's send + receive padded bytes per round <= bucket_bytes."""
    usage: list[list[int]] = []
    members: list[list[WeightTransfer]] = []
    # Rounds a rank has filled up: skip them quickly (first_open[rank] = first round with room).
    first_open = [0] * world
    for t in sorted(transfers, key=lambda t: -t.padded_nbytes):
        size = t.padded_nbytes
        start = max(first_open[t.src_rank], first_open[t.dst_rank])
        for i in range(start, len(usage) + 1):
            if i == len(usage):
                usage.append([0] * world)
                members.append([])
            if usage[i][t.src_rank] + size <= bucket_bytes and (
                usage[i][t.dst_rank] + size <= bucket_bytes
            ):
                usage[i][t.src_rank] += size
                usage[i][t.dst_rank] += size
                members[i].append(t)
                break
        for rank in (t.src_rank, t.dst_rank):
            while first_open[rank] < len(usage) and usage[first_open[rank]][rank] + ALIGN > (
                bucket_bytes
            ):
                first_open[rank] += 1
    rounds = []
    for ts in members:
        ts.sort(key=lambda t: (t.src_rank, t.dst_rank, t.key, t.dst_index, t.region))
        placed, offsets = [], defaultdict(int)
        for t in ts:
            pair = (t.src_rank, t.dst_rank)
            placed.append(dataclasses.replace(t, offset=offsets[pair]))
            offsets[pair] += t.padded_nbytes
        rounds.append(tuple(placed))
    return tuple(rounds)


def plan_summary(plan: WeightPlan) -> dict[str, float]:
    """Per-rank totals of a plan (bytes sent/received/copied locally: max and mean), rounds."""
    ranks = range(plan.world_size)
    sent = [plan.bytes_sent(r) for r in ranks]
    recv = [plan.bytes_received(r) for r in ranks]
    loc = [plan.bytes_local(r) for r in ranks]
    return {
        "rounds": len(plan.rounds),
        "sent_max": max(sent),
        "sent_mean": sum(sent) / len(sent),
        "recv_max": max(recv),
        "recv_mean": sum(recv) / len(recv),
        "local_mean": sum(loc) / len(loc),
        "remote_total": math.fsum(sent),
    }
