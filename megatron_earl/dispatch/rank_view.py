"""A rank's view of a forward dispatch (pure): the whole plan's transfers that involve one rank,
found from the samples of its DP rank and the samples it holds only (``route_rank``), so that
planning costs each rank O(what it sends and receives), not O(the whole batch x ranks).
``plan.plan_dispatch(..., rank=r)`` calls it; ``tests/unit/test_dispatch_plan.py`` compares every
view with the whole plan; docs/dispatch.md, "Planning that scales", says how the shortcuts work.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from megatron_earl.dispatch.batch import Schema
from megatron_earl.dispatch.route import (
    Piece,
    RouteConfig,
    Transfer,
    choose_source,
    fan_out,
)
from megatron_earl.dispatch.spec import Destination, PlanConfig, SourceMeta, cp_real_spans
from megatron_earl.dispatch.table import SampleTable
from megatron_earl.parallel.layout import Coord, ParallelLayout


def stage_count(config: RouteConfig) -> int:
    """Stages of a forward rank view: 2 when TP fan-out may relay inside a node, else 1 (fixed
    from the config, so every rank's view has the same count; the whole plan drops an empty
    second stage)."""
    return 2 if config.relays else 1


def _consumer_classes(
    destination: Destination, schema: Schema, dp_rank: int
) -> list[tuple[int, tuple[str, ...], tuple[int, ...]]]:
    """The consumers of one piece as ``route`` groups them, for DP rank ``dp_rank``: per-token
    pieces by (cp rank, per-token fields), per-sample pieces (cp rank -1) by per-sample fields;
    ranks ascending."""
    layout = destination.layout
    kinds = {s.name: s.per_token for s in schema}
    classes: dict[tuple[int, tuple[str, ...]], list[int]] = defaultdict(list)
    for pp in range(layout.pp):
        fields = destination.stage_fields(schema, pp)
        tok = tuple(f for f in fields if kinds[f])
        smp = tuple(f for f in fields if not kinds[f])
        for cp in range(layout.cp):
            for tp in range(layout.tp):
                r = layout.rank(Coord(tp=tp, cp=cp, dp=dp_rank, pp=pp))
                if tok:
                    classes[(cp, tok)].append(r)
                if smp:
                    classes[(-1, smp)].append(r)
    return [(cp, f, tuple(sorted(rs))) for (cp, f), rs in classes.items()]


def route_rank(
    rank: int,
    sources: Sequence[SourceMeta],
    samples: SampleTable,
    owner: np.ndarray,
    destination: Destination,
    schema: Schema,
    config: PlanConfig,
) -> tuple[tuple[tuple[Transfer, ...], ...], dict[int, list[Piece]]]:
    """The whole plan's transfers with ``rank`` as source or destination, found from the pieces
    of the samples of its DP rank and the samples it holds only (``owner``: each sample row's DP
    rank); and the pieces ``rank`` needs, per sample. Holders of a forward dispatch hold whole
    samples with every field, so a piece's candidate sources are its sample's holders
    (``route._cover`` would not cut it) and ``route.choose_source`` needs nothing else. Samples
    with one holder, the bulk, take shortcuts that give what ``choose_source`` and ``fan_out``
    would: this rank's own pieces of samples another rank holds (numpy, ``_own_pieces``), the
    pieces of samples only this rank holds (``_held_pieces``); samples with replicas go piece
    by piece through ``choose_source`` and ``fan_out``."""
    layout = destination.layout
    me = layout.coord(rank)
    rc = config.route
    classes = _ClassesByDp(destination, schema)
    mine = [c for c in classes[me.dp] if rank in c[2]]
    own_rows = np.flatnonzero(owner == me.dp)
    held_rows = samples.rows(sources[rank].sample_ids)
    is_held = np.zeros(len(samples), dtype=bool)
    is_held[held_rows] = True
    single = samples.num_holders == 1
    in_bulk = ~is_held[own_rows] & single[own_rows]
    ordered, needs = _own_pieces(rank, own_rows[in_bulk], samples, layout, mine, rc)
    records: list[list[tuple]] = [[] for _ in ordered]  # the other samples' (piece, dst, src)
    only_mine = held_rows[single[held_rows]]
    _held_pieces(rank, only_mine, owner, samples, layout, classes, me.dp, rc, records, needs)
    # the rest, samples with replicas: own ones (only this rank's pieces), held ones (all)
    rest = own_rows[~single[own_rows]]
    wanted = list(zip(rest.tolist(), [me.dp] * len(rest), is_held[rest].tolist()))
    away = held_rows[~single[held_rows] & (owner[held_rows] != me.dp)]
    wanted += [(i, d, True) for i, d in zip(away.tolist(), owner[away].tolist())]
    ids, lengths = samples.id_array, samples.length_array
    pieces: dict[tuple, tuple[tuple[int, ...], int]] = {}  # (sample, start, end, fields) -> ..
    for row, d, every in wanted:
        sid, n = int(ids[row]), int(lengths[row])
        own = needs[sid] = [] if d == me.dp else None
        for cp, fields, dsts in classes[d] if every else mine:
            spans = ((-1, -1),) if cp < 0 else cp_real_spans(n, layout.cp, cp)
            for a, b in spans:
                pieces[(sid, a, b, fields)] = (dsts, row)  # .. its consumers and sample row
                if own is not None and rank in dsts:
                    own.append(Piece(sid, a, b, fields))
    for key, (dsts, row) in pieces.items():
        holders = samples.holders(row)
        if rank not in dsts and rank not in holders:
            continue
        piece = Piece(*key)
        src = choose_source(holders, dsts, piece, rc)
        if rank not in dsts and src != rank:
            continue
        for stage, t in fan_out(src, dsts, piece, rc):
            if rank in (t.src, t.dst):
                records[stage].append((piece, t.dst, t.src))
    # the whole plan's order: pieces sorted, a piece's transfers by destination
    new = tuple.__new__  # Transfer(src, dst, piece) without the named tuple's Python __new__
    return tuple(
        tuple(_merge(own, [new(Transfer, (src, dst, p)) for p, dst, src in sorted(r)]))
        for own, r in zip(ordered, records)
    ), needs


class _ClassesByDp(dict):
    """DP rank -> ``_sorted_classes`` of it, computed once for DP rank 0: in the rank order
    tp-cp-dp-pp (``ParallelLayout``) DP rank ``d``'s consumers are DP rank 0's plus
    ``d * tp * cp``."""

    def __init__(self, destination: Destination, schema: Schema) -> None:
        super().__init__()
        layout = destination.layout
        self.base = _sorted_classes(destination, schema, 0)
        self.stride = layout.rank(Coord(tp=0, cp=0, dp=1, pp=0)) if layout.dp > 1 else 0

    def __missing__(self, dp_rank: int) -> list:
        shift = dp_rank * self.stride
        out = self[dp_rank] = [(cp, f, tuple(r + shift for r in rs)) for cp, f, rs in self.base]
        return out


def _sorted_classes(destination: Destination, schema: Schema, dp_rank: int) -> list:
    """``_consumer_classes`` with token classes first (a rank's needs list spans, then rows)."""
    return sorted(_consumer_classes(destination, schema, dp_rank), key=lambda c: c[0] < 0)


def _held_pieces(
    rank: int,
    rows: np.ndarray,
    owner: np.ndarray,
    samples: SampleTable,
    layout: ParallelLayout,
    classes: _ClassesByDp,
    own_dp: int,
    rc: RouteConfig,
    records: list[list[tuple]],
    needs: dict[int, list[Piece]],
) -> None:
    """Add the transfers of the samples of ``rows``, held by ``rank`` alone, to ``records``
    (``(piece, dst, src)`` per stage) and the pieces ``rank`` needs of those of its DP rank to
    ``needs``: what ``choose_source`` (the one holder) and ``fan_out`` give. A piece goes to
    every consumer on this rank's node, and to one leader (``dsts[sample_id % n]`` of the node's
    ``n`` consumers) on every other node, which forwards it in stage 1 (not this rank's)."""
    relay = rc.relays
    here = rc.node(rank)
    new = tuple.__new__  # Piece(...) without the named tuple's Python __new__
    groups: dict[int, list] = {}  # DP rank -> per class: [(consumers, relayed)] by node
    for d, sid, n in zip(
        owner[rows].tolist(), samples.id_array[rows].tolist(), samples.length_array[rows].tolist()
    ):
        if d not in groups:
            groups[d] = []
            for _, _, dsts in classes[d]:
                by_node: dict[int, list[int]] = defaultdict(list)
                for x in dsts:
                    by_node[rc.node(x)].append(x)
                groups[d].append(
                    [(g, relay and node != here and len(g) > 1) for node, g in by_node.items()]
                )
        own = needs[sid] = [] if d == own_dp else None
        for (cp, fields, dsts), by_node in zip(classes[d], groups[d]):
            spans = ((-1, -1),) if cp < 0 else cp_real_spans(n, layout.cp, cp)
            for a, b in spans:
                p = new(Piece, (sid, a, b, fields))
                if own is not None and rank in dsts:
                    own.append(p)
                for g, relayed in by_node:
                    if relayed:
                        records[0].append((p, g[sid % len(g)], rank))
                    else:
                        records[0] += [(p, x, rank) for x in g]


def _own_pieces(
    rank: int,
    rows: np.ndarray,
    samples: SampleTable,
    layout: ParallelLayout,
    mine: list,
    rc: RouteConfig,
) -> tuple[list[list[Transfer]], dict[int, list[Piece]]]:
    """This rank's pieces of the samples of ``rows`` (samples of its DP rank held by one other
    rank each, ascending ids): the transfers per stage, in the whole plan's order (pieces sorted,
    a piece's transfers by destination), and its needs, per sample; what ``choose_source`` (the
    one holder) and ``fan_out`` give this consumer, vectorised per class and span."""
    transfers: list[list[Transfer]] = [[] for _ in range(stage_count(rc))]
    needs: dict[int, list[Piece]] = {}
    if not len(rows):
        return transfers, needs
    sid, n, holder = samples.id_array[rows], samples.length_array[rows], samples.owners[rows]
    k = rc.ranks_per_node
    relay = rc.relays
    # a rank has one CP rank and one stage: at most a token class and a per-sample class. The
    # per-sample piece (start -1) sorts before the spans (ascending) but is needed after them
    columns = []  # per class and span, in the plan's order
    for cp, fields, dsts in sorted(mine, key=lambda c: c[0] >= 0):
        if cp < 0:
            spans = [(np.full_like(n, -1), np.full_like(n, -1))]
        elif layout.cp == 1:
            spans = [(np.zeros_like(n), n)]
        else:
            c2 = 2 * layout.cp
            chunk = -(-n // c2)
            first, second = cp, c2 - 1 - cp
            spans = [
                (first * chunk, np.minimum((first + 1) * chunk, n)),
                (second * chunk, np.minimum((second + 1) * chunk, n)),
            ]
        group = [d for d in dsts if d // k == rank // k] if relay else [rank]
        # where the piece comes from: the holder (stage 0); a piece from another node comes
        # once to the node's leader, which forwards it (stage 1); -1: this rank leads
        via = holder
        if relay and len(group) > 1:
            leader = np.asarray(group)[sid % len(group)]
            via = np.where(holder // k == rank // k, holder, np.where(leader == rank, -1, leader))
        others = [d for d in group if d != rank]
        for a, b in spans:
            kept = ((b > a) | (a < 0)).tolist()
            columns.append((fields, a.tolist(), b.tolist(), kept, via.tolist(), others))
    s0, s1 = transfers[0], transfers[-1]
    row_last = bool(columns) and columns[0][1][0] < 0  # a per-sample column comes first
    new = tuple.__new__  # Piece(...), Transfer(...) without the named tuple's Python __new__
    for i, (q, h) in enumerate(zip(sid.tolist(), holder.tolist())):
        pieces = []
        for fields, a, b, kept, via, others in columns:
            if not kept[i]:
                continue
            p = new(Piece, (q, a[i], b[i], fields))
            pieces.append(p)
            v = via[i]
            if v == h:
                s0.append(new(Transfer, (h, rank, p)))
            elif v >= 0:
                s1.append(new(Transfer, (v, rank, p)))
            else:
                s0.append(new(Transfer, (h, rank, p)))
                s1 += [new(Transfer, (rank, d, p)) for d in others]
        needs[q] = pieces[1:] + pieces[:1] if row_last else pieces
    return transfers, needs


def _merge(ordered: list[Transfer], other: list[Transfer]) -> list[Transfer]:
    """Two lists of transfers in the plan's order, of disjoint samples, merged in that order."""
    if not ordered or not other:
        return ordered or other
    out: list[Transfer] = []
    i = 0
    for sample_id, block in itertools.groupby(other, key=_sample_of):
        j = bisect.bisect_left(ordered, sample_id, lo=i, key=_sample_of)
        out += ordered[i:j]
        out += block
        i = j
    return out + ordered[i:]


def _sample_of(t: Transfer) -> int:
    return t.piece.sample_id
