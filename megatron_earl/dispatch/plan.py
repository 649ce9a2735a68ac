"""The dispatch planner (pure): which destination rank needs which slice of which sample and field.

Inputs are small metadata that every rank has after one all-gather (``SourceMeta`` per rank: the
ids, lengths and groups of the samples it holds, plus the batch ``Schema``) and a ``Destination`` (a
``ParallelLayout`` and a phase). The planner

1. assigns samples to destination DP ranks, balanced by a cost (tokens, or tokens plus an
   attention-quadratic term), keeping a group's samples together when asked (``assign_samples``);
2. plans each DP rank's micro-batches under a per-rank token budget, grouped into mini-batches
   (``plan_micro_batches``): these are the micro-batches the consumer runs (the experience
   log-prob pass, each optimizer step of the train step), not a transport unit it repacks;
3. lists what every rank needs: its DP share, only its context-parallel chunks
   (``cp_chunk_bounds``), only the fields its pipeline stage reads (``Destination.stage_fields``);
4. routes those needs from the holders (``route.route``), producing ``Transfer`` stages.

``plan_dispatch(..., rank=r)`` plans rank ``r``'s *view*: steps 1 and the checks run over every
sample (O(samples), on numpy arrays: no Python object per sample), steps 2-4 only for what ``r``
receives (its DP rank's samples) and sends (the samples it holds), giving exactly the whole plan's
transfers that involve ``r`` (``_route_rank``; tests compare them). This is what each rank runs
(``execute.plan_for``).

Every function is deterministic in its inputs, so every rank computes the same plan, and every user
error is raised here from the global inputs, on every rank alike, before any data moves.

Context-parallel chunking (Megatron's load-balanced scheme, shared with CP attention): a sequence is
padded to a multiple of ``2 * cp`` and cut into ``2 * cp`` equal chunks; CP rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r`` (an early and a late chunk, so causal-attention work is balanced).
With ``cp == 1`` nothing is padded.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_earl.config.vocab import PHASES, Phase
from megatron_earl.dispatch.balance import (
    BalanceMemo,
    assign_samples,
    balance,
    split_by_owner,
)
from megatron_earl.dispatch.batch import Schema
from megatron_earl.dispatch.route import (
    DispatchError,
    Piece,
    RouteConfig,
    Transfer,
    choose_source,
    fan_out,
    route,
)
from megatron_earl.dispatch.table import SampleInfo, SampleTable, collect
from megatron_earl.parallel.cp import cp_chunk_bounds, cp_padded_length
from megatron_earl.parallel.layout import Coord, ParallelLayout

__all__ = [
    "DispatchError",
    "DispatchPlan",
    "assign_samples",
    "cp_chunk_bounds",
    "cp_padded_length",
    "plan_dispatch",
    "plan_return",
]


# ---------------------------------------------------------------------- context-parallel chunks


def cp_real_spans(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """``cp_chunk_bounds`` clipped to the real tokens, empty ranges dropped (what is sent)."""
    spans = [(a, min(b, seq_len)) for a, b in cp_chunk_bounds(seq_len, cp, cp_rank)]
    return [(a, b) for a, b in spans if b > a]


# ---------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class SourceMeta:
    """What one rank holds before the dispatch (all-gathered, so every rank sees all of them)."""

    sample_ids: tuple[int, ...] = ()
    """Global ids of the samples this rank holds (a sample held by several ranks is a replica)."""
    lengths: tuple[int, ...] = ()
    """Their lengths in tokens."""
    group_ids: tuple[int, ...] = ()
    """Their groups (samples of one prompt)."""


@dataclass(frozen=True)
class Destination:
    """Where the batch goes: a layout, a phase, and which fields each pipeline stage reads."""

    layout: ParallelLayout
    """The consuming layout."""
    phase: Phase = Phase.TRAIN
    """One of ``PHASES`` (recorded in the plan; the stage fields below carry the behaviour)."""
    first_stage_fields: tuple[str, ...] = ("tokens",)
    """Fields the first pipeline stage reads (the embedding input)."""
    last_stage_fields: tuple[str, ...] | None = None
    """Fields the last stage reads (targets, masks, log-probs, advantages); None = every field."""
    middle_stage_fields: tuple[str, ...] = ()
    """Fields the stages between the first and the last read (none for a plain forward; a
    consumer that plans micro-batches on every stage needs at least the lengths' carrier)."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise DispatchError(f"phase {self.phase!r} is not one of {PHASES}")

    def stage_fields(self, schema: Schema, pp_rank: int) -> tuple[str, ...]:
        """Names of the fields pipeline stage ``pp_rank`` receives (middle stages: none)."""
        names = [s.name for s in schema]
        last = tuple(names) if self.last_stage_fields is None else self.last_stage_fields
        for label, wanted in (
            ("first_stage_fields", self.first_stage_fields),
            ("last_stage_fields", last),
            ("middle_stage_fields", self.middle_stage_fields),
        ):
            missing = sorted(set(wanted) - set(names))
            if missing:
                raise DispatchError(f"{label} names {missing}, not in the batch; fields: {names}")
        chosen: set[str] = set()
        if pp_rank == 0:
            chosen |= set(self.first_stage_fields)
        if pp_rank == self.layout.pp - 1:
            chosen |= set(last)
        if 0 < pp_rank < self.layout.pp - 1:
            chosen |= set(self.middle_stage_fields)
        return tuple(n for n in names if n in chosen)


@dataclass(frozen=True)
class PlanConfig:
    """How to balance, micro-batch and route."""

    max_tokens_per_micro_batch: int | None = None
    """Per-rank token budget of one micro-batch (tokens a rank holds: padded length / cp); None =
    one micro-batch per DP rank. A sample above it is an error (see docs/dispatch.md)."""
    attention_weight: float = 0.0
    """Balancing cost of a sample is ``len + attention_weight * len**2 / 1024``; 0 balances tokens,
    > 0 also balances quadratic attention work of long sequences."""
    keep_groups: bool = False
    """Keep all samples of a group on the same DP rank (e.g. group-normalised losses)."""
    route: RouteConfig = field(default_factory=RouteConfig)
    """Source choice and TP fan-out (see ``route.RouteConfig``)."""
    num_mini_batches: int = 1
    """Mini-batches (optimizer steps) each DP rank's micro-batches are grouped into."""
    consumer_cp: int | None = None
    """Context-parallel size the consumer splits the micro-batches over itself when every rank of
    a replica receives whole samples (CP folded into TP, ``orchestration.samples.replica_layout``):
    the budget then counts ``cp_padded_length(len, consumer_cp) / consumer_cp`` tokens per sample.
    None: the destination layout's cp."""

    def __post_init__(self) -> None:
        if self.num_mini_batches < 1:
            raise DispatchError(f"num_mini_batches={self.num_mini_batches}; use >= 1")
        if self.consumer_cp is not None and self.consumer_cp < 1:
            raise DispatchError(f"consumer_cp={self.consumer_cp}; use >= 1 or None")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise DispatchError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}; use >= 1 or None"
            )
        if self.attention_weight < 0:
            raise DispatchError(f"attention_weight={self.attention_weight}; use >= 0")

    def cost(self, length: float | np.ndarray) -> float | np.ndarray:
        """A sample's balance cost: its tokens plus ``attention_weight`` x tokens^2 / 1024
        (elementwise on an array of lengths)."""
        return length + self.attention_weight * length * length / 1024


# ---------------------------------------------------------------------- micro-batches


def pack_micro_batches(
    sample_ids: Sequence[int], lengths: dict[int, int], cp: int, budget: int | None
) -> list[list[int]]:
    """First-fit-decreasing packing of one DP rank's samples under a per-rank token budget.

    A sample costs ``cp_padded_length(len, cp) / cp`` tokens on each CP rank; one above the budget
    raises (sequences are never split across micro-batches: attention needs the whole sequence)."""
    if budget is None:
        return [list(sample_ids)]
    local = {s: cp_padded_length(lengths[s], cp) // cp for s in sample_ids}
    over = [s for s in sample_ids if local[s] > budget]
    if over:
        s = max(over, key=lambda s: local[s])
        raise _over_budget(s, lengths[s], len(over), cp, budget)
    bins: list[list[int]] = []
    room: list[int] = []
    for s in sorted(sample_ids, key=lambda s: (-local[s], s)):
        i = next((i for i, r in enumerate(room) if r >= local[s]), None)
        if i is None:
            bins.append([])
            room.append(budget)
            i = len(bins) - 1
        bins[i].append(s)
        room[i] -= local[s]
    return bins


def _over_budget(sample_id: int, length: int, count: int, cp: int, budget: int) -> DispatchError:
    local = cp_padded_length(length, cp) // cp
    fit_cp = next(
        (c for c in range(cp, 2 * length + 2) if cp_padded_length(length, c) // c <= budget),
        None,
    )
    return DispatchError(
        f"sample {sample_id} has {length} tokens = {local} per rank at cp={cp}, above "
        f"max_tokens_per_micro_batch={budget} ({count} such samples); raise the budget to "
        f">= {local} or use cp >= {fit_cp}"
    )


def balance_micro_batches(
    sample_ids: Sequence[int],
    lengths: dict[int, int],
    cp: int,
    budget: int | None,
    packed: list[list[int]] | None = None,
) -> list[list[int]]:
    """The micro-batches a consumer runs: as many as first-fit-decreasing needs
    (``pack_micro_batches``, which raises for a sample above the budget), with the samples then
    spread largest-first onto the lightest micro-batch that has room, so micro-batches carry
    similar token counts. Inside a micro-batch, samples keep their order in ``sample_ids``.
    Where the balanced spread does not fit that many micro-batches, FFD's packing is kept.

    ``packed``: FFD's packing of the same samples at this ``cp`` and ``budget`` when the caller
    has it and ``sample_ids`` is its concatenation (``plan_micro_batches`` with one mini-batch):
    FFD then runs once. It equals the packing computed here: among samples of equal size FFD
    places lower ids in the same or an earlier bin, so positions in the concatenation order them
    as ids do, and FFD takes the samples in the same sequence."""
    if not sample_ids:
        return []
    ids = list(sample_ids)
    if budget is None:  # one micro-batch of every sample, in order
        return [ids]
    at = {i: lengths[s] for i, s in enumerate(ids)}  # positions: ties break by position
    if packed is None:
        ffd = pack_micro_batches(range(len(ids)), at, cp, budget)
    else:
        position = {s: i for i, s in enumerate(ids)}
        ffd = [[position[s] for s in b] for b in packed]
    cost = [cp_padded_length(at[i], cp) // cp for i in range(len(ids))]
    bins: list[list[int]] = [[] for _ in ffd]
    loads = [0] * len(ffd)
    for i in sorted(range(len(ids)), key=lambda i: (-cost[i], i)):
        fits = [b for b in range(len(bins)) if loads[b] + cost[i] <= budget]
        if not fits:
            break
        b = min(fits, key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += cost[i]
    else:
        ffd = bins
    return [[ids[i] for i in sorted(b)] for b in ffd]


def plan_micro_batches(
    sample_ids: Sequence[int],
    lengths: dict[int, int],
    cp: int,
    config: PlanConfig,
    consumer_cp: int | None = None,
) -> list[list[list[int]]]:
    """One DP rank's mini-batches, each a list of micro-batches (sample ids): the one plan of
    what the consumer runs, so it consumes the dispatched micro-batches as they arrive.

    The samples are taken in first-fit-decreasing order at the destination's ``cp``
    (``pack_micro_batches``; an empty DP rank has none), mini-batch ``i`` holds every
    ``num_mini_batches``-th of them from the ``i``-th, and each mini-batch is balanced into
    micro-batches at ``consumer_cp`` (default ``cp``) under the same budget
    (``balance_micro_batches``; with one mini-batch at ``cp`` it reuses the packing above)."""
    budget = config.max_tokens_per_micro_batch
    ffd = pack_micro_batches(sample_ids, lengths, cp, budget)
    order = [s for mb in ffd for s in mb]
    n = config.num_mini_batches
    consumer_cp = consumer_cp or cp
    # one mini-batch at the same cp: the FFD above is the one balancing needs (run it once)
    packed = ffd if n == 1 and consumer_cp == cp else None
    return [
        balance_micro_batches(order[i::n], lengths, consumer_cp, budget, packed) for i in range(n)
    ]


# ---------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Plan:
    """Transfers that turn ``holdings`` into ``needs`` (identical on every rank)."""

    schema: Schema
    holdings: dict[int, list[Piece]]
    needs: dict[int, list[Piece]]
    stages: tuple[tuple[Transfer, ...], ...]

    def traffic(self, stages: Sequence[Sequence[Transfer]] | None = None) -> dict[str, list[int]]:
        """Bytes sent and received per rank over all stages (local copies excluded)."""
        row_bytes = {s.name: s.row_bytes for s in self.schema}
        world = 1 + max([*self.holdings, *self.needs], default=0)
        sent, recv = [0] * world, [0] * world
        for stage in self.stages if stages is None else stages:
            for t in stage:
                if t.src != t.dst:
                    n = t.nbytes(row_bytes)
                    sent[t.src] += n
                    recv[t.dst] += n
        return {"sent": sent, "recv": recv}


@dataclass(frozen=True)
class DispatchPlan(Plan):
    """A forward dispatch: source ranks' samples -> the destination layout's micro-batches.

    A *rank view* (``rank`` set, what ``plan_dispatch(..., rank=r)`` and ``execute.plan_for``
    return) holds only what rank ``r`` sends and receives: ``needs`` and ``holdings`` of ``r``, the
    transfers with ``r`` as source or destination (in the same stages and order as the whole
    plan's), and the micro-batches of ``r``'s DP rank (other DP ranks' entries are empty). The
    global parts (``samples``, ``assignment``, ``source_order``) are complete in every view."""

    destination: Destination | None = None
    config: PlanConfig | None = None
    samples: Mapping[int, SampleInfo] = field(default_factory=dict)
    source_order: tuple[tuple[int, ...], ...] = ()
    """Sample ids per source rank, in that rank's batch order."""
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """``micro_batches[dp_rank][i]``: the sample ids of micro-batch ``i`` of that DP rank."""
    mini_batch_sizes: tuple[tuple[int, ...], ...] = ()
    """``mini_batch_sizes[dp_rank][j]``: how many of that DP rank's consecutive micro-batches
    make mini-batch ``j`` (``PlanConfig.num_mini_batches`` entries)."""
    assignment: tuple[tuple[int, ...], ...] = ()
    """``assignment[dp_rank]``: the sample ids of that DP rank, ascending (every view)."""
    rank: int | None = None
    """The rank this view was planned for; None: the whole plan."""

    def dp_tokens(self) -> list[int]:
        return [sum(self.samples[s].length for s in ids) for ids in self.assignment]

    def dp_of(self) -> dict[int, int]:
        """Sample id -> the DP rank it goes to."""
        return {s: d for d, ids in enumerate(self.assignment) for s in ids}


def plan_dispatch(
    sources: Sequence[SourceMeta],
    schema: Schema,
    destination: Destination,
    config: PlanConfig | None = None,
    rank: int | None = None,
    routed: bool = True,
    balances: BalanceMemo | None = None,
) -> DispatchPlan:
    """Plan moving the samples of ``sources`` (one entry per rank) to ``destination``.

    ``rank=None`` plans the whole dispatch (every rank's needs and every transfer); ``rank=r``
    plans the rank view of ``r`` (see ``DispatchPlan``): the balance is global (O(samples)), the
    rest O(what ``r`` sends and receives). Every error is raised from the global inputs, so every
    rank raises the same one whatever view it plans. ``routed=False`` leaves ``stages`` empty
    (for the centralized baseline, which routes through its root instead). ``balances``: balance
    through this memo (``BalanceMemo``: plans of the same samples to the same dp balance once)."""
    config = config or PlanConfig()
    layout = destination.layout
    if len(sources) != layout.world_size:
        raise DispatchError(
            f"destination layout {layout} has tp({layout.tp}) * cp({layout.cp}) * pp({layout.pp})"
            f" * dp({layout.dp}) = {layout.world_size} ranks, but {len(sources)} ranks dispatch; "
            f"use a layout of {len(sources)} ranks"
        )
    if config.consumer_cp not in (None, layout.cp) and layout.cp > 1:
        raise DispatchError(
            f"consumer_cp={config.consumer_cp} with a destination of cp={layout.cp}: a consumer "
            "splits for CP itself only when it receives whole samples (destination cp=1)"
        )
    if rank is not None and not 0 <= rank < layout.world_size:
        raise DispatchError(f"rank={rank}; valid: 0..{layout.world_size - 1} or None")
    for pp in range(layout.pp):
        destination.stage_fields(schema, pp)  # raises for unknown stage fields
    samples = collect(sources)
    ids, dp = samples.id_array, layout.dp
    balancer = balance if balances is None else balances.balance
    owner = balancer(ids, samples.length_array, samples.group_array, dp, config)
    assignment = split_by_owner(ids, owner, dp)
    _check_budget(samples, layout.cp, config)
    own_dp = None if rank is None else layout.coord(rank).dp
    if rank is None:
        lengths = dict(zip(samples.ids, samples.lengths))
    else:  # the lengths this view reads: its DP rank's samples and the samples it holds
        rows = np.r_[np.flatnonzero(owner == own_dp), samples.rows(sources[rank].sample_ids)]
        lengths = dict(zip(ids[rows].tolist(), samples.length_array[rows].tolist()))
    minis = [
        plan_micro_batches(a, lengths, layout.cp, config, config.consumer_cp)
        if own_dp in (None, d)
        else []
        for d, a in enumerate(assignment)
    ]
    micro = tuple(tuple(tuple(mb) for mini in m for mb in mini) for m in minis)
    token = tuple(s.name for s in schema if s.per_token)
    per_sample = tuple(s.name for s in schema if not s.per_token)
    ranks = range(layout.world_size) if rank is None else [rank]
    holdings = {r: _full_pieces(sources[r].sample_ids, lengths, token, per_sample) for r in ranks}
    if rank is not None and routed:
        stages, own = _route_rank(rank, sources, samples, owner, destination, schema, config)
        needs = {rank: [p for mb in micro[own_dp] for sid in mb for p in own[sid]]}
    else:
        needs = {
            r: rank_needs(destination, schema, r, micro[layout.coord(r).dp], lengths) for r in ranks
        }
        stages = () if not routed else tuple(route(holdings, needs, schema, config.route))
        stages = tuple(tuple(s) for s in stages)
    return DispatchPlan(
        schema=schema,
        holdings=holdings,
        needs=needs,
        stages=stages,
        destination=destination,
        config=config,
        samples=samples,
        source_order=tuple(map(tuple, [s.sample_ids for s in sources])),
        micro_batches=micro,
        mini_batch_sizes=tuple(tuple(len(mini) for mini in m) for m in minis),
        assignment=tuple(tuple(a) for a in assignment),
        rank=rank,
    )


def rank_needs(
    destination: Destination,
    schema: Schema,
    rank: int,
    micro_batches: Sequence[Sequence[int]],
    lengths: Mapping[int, int],
) -> list[Piece]:
    """The pieces ``rank`` needs of the samples of ``micro_batches`` (in their order): its CP
    chunks of its stage's per-token fields, and its stage's per-sample fields."""
    layout = destination.layout
    c = layout.coord(rank)
    kinds = {s.name: s.per_token for s in schema}
    fields = destination.stage_fields(schema, c.pp)
    tok = tuple(f for f in fields if kinds[f])
    smp = tuple(f for f in fields if not kinds[f])
    out: list[Piece] = []
    for mb in micro_batches:
        for sid in mb:
            if tok:
                spans = cp_real_spans(lengths[sid], layout.cp, c.cp)
                out += [Piece(sid, a, b, tok) for a, b in spans]
            if smp:
                out.append(Piece(sid, -1, -1, smp))
    return out


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


def _route_rank(
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


def _check_budget(samples: SampleTable, cp: int, config: PlanConfig) -> None:
    """Raise for samples above the per-rank token budget at ``cp`` and at the consumer's cp
    (from every sample, so every rank raises the same error)."""
    budget = config.max_tokens_per_micro_batch
    if budget is None:
        return
    for c in dict.fromkeys([cp, config.consumer_cp or cp]):
        lengths = samples.length_array
        local = (-(-lengths // (2 * c)) * 2) if c > 1 else lengths
        over = np.flatnonzero(local > budget)
        if len(over):
            i = int(over[np.argmax(local[over])])
            raise _over_budget(int(samples.id_array[i]), int(lengths[i]), len(over), c, budget)


def plan_return(plan: DispatchPlan, results: Schema, stage: str = "last") -> Plan:
    """Plan sending ``results`` (fields computed in the destination layout, held by every rank of
    pipeline stage ``stage`` in its CP chunks) back to each sample's owner on the source side.

    For a rank view of the forward plan, a rank view too: only the samples the rank owns or holds
    in the destination are routed, and only transfers with the rank as source or destination
    kept (one stage, possibly empty, on every rank)."""
    layout = plan.destination.layout
    if stage not in ("first", "last"):
        raise DispatchError(f"stage={stage!r}; valid: 'first', 'last'")
    pp_rank = 0 if stage == "first" else layout.pp - 1
    token = tuple(s.name for s in results if s.per_token)
    per_sample = tuple(s.name for s in results if not s.per_token)
    me = plan.rank
    if me is None:
        relevant = [(s, d) for d, ids in enumerate(plan.assignment) for s in ids]
    else:
        dp_of = plan.dp_of()
        c = layout.coord(me)
        own = plan.assignment[c.dp] if c.pp == pp_rank else ()
        mine = [s for s in plan.source_order[me] if plan.samples[s].holders[0] == me]
        relevant = sorted({**{s: c.dp for s in own}, **{s: dp_of[s] for s in mine}}.items())
    everyone = range(layout.world_size) if me is None else ()
    holdings: dict[int, list[Piece]] = defaultdict(list, {r: [] for r in everyone})
    needs: dict[int, list[Piece]] = defaultdict(list, {r: [] for r in everyone})
    for sid, d in relevant:
        info = plan.samples[sid]
        for cp in range(layout.cp):
            for tp in range(layout.tp):
                r = layout.rank(Coord(tp=tp, cp=cp, dp=d, pp=pp_rank))
                if token:
                    spans = cp_real_spans(info.length, layout.cp, cp)
                    holdings[r] += [Piece(sid, a, b, token) for a, b in spans]
                if per_sample:
                    holdings[r].append(Piece(sid, -1, -1, per_sample))
        needs[info.holders[0]] += _full_pieces([sid], {sid: info.length}, token, per_sample)
    stages = route(dict(holdings), dict(needs), results, plan.config.route)
    if me is not None:
        stages = [[t for s in stages for t in s if me in (t.src, t.dst)]]
        holdings = {me: holdings.get(me, [])}
        needs = {me: needs.get(me, [])}
    return Plan(results, dict(holdings), dict(needs), tuple(tuple(s) for s in stages))


def _full_pieces(
    sample_ids: Sequence[int],
    lengths: Mapping[int, int],
    token: tuple[str, ...],
    per_sample: tuple[str, ...],
) -> list[Piece]:
    out = []
    for sid in sample_ids:
        out += [Piece(sid, 0, lengths[sid], token)] if token else []
        out += [Piece(sid, -1, -1, per_sample)] if per_sample else []
    return out
