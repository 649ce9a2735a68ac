"""Cache of weight-reshard plans: a repeated reshard costs one small all-reduce, not a replan.

    cache = PlanCache()                       # or the process's PLAN_CACHE (the default)
    plan, cached = cache.plan(src_pieces, dst_pieces, bucket_bytes, group)

A plan (``weight_plan.plan_weights``) is a pure function of every rank's piece metadata, the
bucket bound and the group. Making it costs an all-gather of pickled metadata and the planning
itself (milliseconds to tens of milliseconds); a training loop reshards the same models between
the same layouts every step. So each rank keeps its recent plans, keyed on its own inputs:

- **local key** (``local_key``): exactly this rank's inputs, compared by equality (no hash can
  collide): the group's global ranks and this rank's place in them, ``bucket_bytes``, and for every
  source and destination piece, in order, its key, global shape, region, dtype and parameter name.
  The layout pair, the parameter set, names, shapes and dtypes all show up in it: a layout changes
  regions (and which keys a pipeline stage holds), a model changes keys and shapes.
- **global digest**: 62 bits of BLAKE2b over the all-gathered metadata of every rank (and the
  bucket), computed when the plan is made: the same number on every rank that made this plan.

On every call each rank looks its local key up, then every rank of the group joins one all-reduce
(MAX, on the group's host twin) of three integers: ``[missed, digest, -digest]``. The plan is reused
only when no rank missed and every rank's entry has the same digest (max == min); otherwise every
rank all-gathers metadata and plans afresh, and stores the new entry. Every rank sees the same
reduced values, so all take the same branch and nothing hangs.

Why the agreement is needed (and not free): a rank's key covers only its own pieces. Another rank
may change its pieces (a rebuilt model, another layout, another order) while this rank's stay the
same; its stale plan would then pair messages of different sizes. Nothing all ranks already agree
on determines every rank's pieces, so one reduction of 24 bytes checks it, instead of the pickled
all-gather of every piece's metadata.

What invalidates an entry: any change of any rank's local key (layout pair, parameter set, names,
shapes, dtypes, bucket, group ranks) -- that rank misses, the reduction tells everyone. Entries are
never updated in place; the least recently used is dropped beyond ``max_entries``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_earl.parallel.groups import host_group
from megatron_earl.redistribute.geometry import ShardPiece
from megatron_earl.redistribute.weight_plan import PieceMeta, WeightPlan, plan_weights

_DIGEST_BITS = 62
"""Bits of the global digest: small enough that its negation fits an int64."""


def piece_metas(pieces: Sequence[ShardPiece]) -> list[PieceMeta]:
    """Planner metadata of local pieces (local, no communication)."""
    return [PieceMeta(p.key, p.global_shape, p.region, p.local.element_size()) for p in pieces]


def local_key(
    src_pieces: Sequence[ShardPiece],
    dst_pieces: Sequence[ShardPiece],
    bucket_bytes: int,
    group: dist.ProcessGroup | None = None,
) -> tuple:
    """This rank's inputs to a plan, as a hashable value (local, no communication)."""

    def describe(pieces: Sequence[ShardPiece]) -> tuple:
        return tuple((p.key, p.global_shape, p.region, p.local.dtype, p.param_name) for p in pieces)

    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    return (ranks, dist.get_rank(group), bucket_bytes, describe(src_pieces), describe(dst_pieces))


@dataclass
class PlanCacheStats:
    """What a cache did since it was made or cleared (per rank)."""

    hits: int = 0
    """Calls that reused a plan (one all-reduce, no all-gather, no planning)."""
    plans: int = 0
    """Calls that all-gathered metadata and planned."""
    disagreements: int = 0
    """Of ``plans``: calls where this rank's own key hit but another rank's did not (or hit
    another plan)."""


@dataclass(frozen=True)
class _Entry:
    plan: WeightPlan
    digest: int


class PlanCache:
    """Recent reshard plans of this rank, reused when every rank's inputs are unchanged."""

    def __init__(self, max_entries: int = 16) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.stats = PlanCacheStats()
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every plan and reset the stats (local)."""
        self._entries.clear()
        self.stats = PlanCacheStats()

    def plan(
        self,
        src_pieces: Sequence[ShardPiece],
        dst_pieces: Sequence[ShardPiece],
        bucket_bytes: int,
        group: dist.ProcessGroup | None = None,
    ) -> tuple[WeightPlan, bool]:
        """(the plan, whether it came from the cache). Identical on every rank.

        Collective: every rank of ``group`` (default: world) calls it with its own pieces; one
        all-reduce of three integers on ``group``'s host twin, then, unless every rank hit the
        same plan, the metadata all-gather of ``gather_and_plan`` on it too.
        """
        key = local_key(src_pieces, dst_pieces, bucket_bytes, group)
        entry = self._entries.get(key)
        digest = entry.digest if entry is not None else 0
        votes = torch.tensor([int(entry is None), digest, -digest], dtype=torch.int64)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=host_group(group))
        missed, high, neg_low = votes.tolist()
        if not missed and high == -neg_low:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry.plan, True
        self.stats.plans += 1
        self.stats.disagreements += entry is not None
        plan, digest = gather_and_plan(src_pieces, dst_pieces, bucket_bytes, group)
        self._entries[key] = _Entry(plan, digest)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return plan, False


def gather_and_plan(
    src_pieces: Sequence[ShardPiece],
    dst_pieces: Sequence[ShardPiece],
    bucket_bytes: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[WeightPlan, int]:
    """All-gather every rank's piece metadata and plan (no cache): (plan, global digest).

    Collective: every rank of ``group`` (default: world) calls it, with its own pieces (possibly
    none); the all-gather runs on ``group``'s host twin. Plan and digest are identical on every
    rank.
    """
    gathered: list = [None] * dist.get_world_size(group)
    mine = (tuple(piece_metas(src_pieces)), tuple(piece_metas(dst_pieces)))
    dist.all_gather_object(gathered, mine, group=host_group(group))
    src = tuple(g[0] for g in gathered)
    dst = tuple(g[1] for g in gathered)
    plan = plan_weights(src, dst, bucket_bytes)
    # repr, not pickle: the same text on every rank whatever object sharing unpickling made.
    blob = repr((src, dst, bucket_bytes)).encode()
    raw = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
    return plan, raw >> (64 - _DIGEST_BITS)


PLAN_CACHE = PlanCache()
"""The process's cache: what ``weight_exec.reshard_weights`` and ``gather_plan`` use unless given
another (or None). Every rank holds its own; they agree through ``PlanCache.plan``'s all-reduce."""
