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
transfers that involve ``r`` (``rank_view.route_rank``; tests compare them). This is what each rank
runs (``execute.plan_for``). The inputs' types are in ``dispatch.spec``.

Every function is deterministic in its inputs, so every rank computes the same plan, and every user
error is raised here from the global inputs, on every rank alike, before any data moves.

Context-parallel chunking (Megatron's load-balanced scheme, shared with CP attention): a sequence is
padded to a multiple of ``2 * cp`` and cut into ``2 * cp`` equal chunks; CP rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r`` (an early and a late chunk, so causal-attention work is balanced).
With ``cp == 1`` nothing is padded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_earl.dispatch.balance import (
    BalanceMemo,
    assign_samples,
    balance,
    split_by_owner,
)
from megatron_earl.dispatch.batch import Schema
from megatron_earl.dispatch.rank_view import route_rank
from megatron_earl.dispatch.route import (
    DispatchError,
    Piece,
    Transfer,
    route,
)
from megatron_earl.dispatch.spec import (
    Destination,
    PlanConfig,
    SourceMeta,
    cp_real_spans,
)
from megatron_earl.dispatch.table import SampleInfo, SampleTable, collect
from megatron_earl.parallel.cp import cp_chunk_bounds, cp_padded_length
from megatron_earl.parallel.layout import Coord

__all__ = [
    "DispatchError",
    "DispatchPlan",
    "assign_samples",
    "cp_chunk_bounds",
    "cp_padded_length",
    "plan_dispatch",
    "plan_return",
]


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
    groups: dict[int, int] | None = None,
) -> list[list[int]]:
    """The micro-batches a consumer runs: as many as first-fit-decreasing needs
    (``pack_micro_batches``, which raises for a sample above the budget), with the samples then
    spread largest-first onto the lightest micro-batch that has room, so micro-batches carry
    similar token counts. Inside a micro-batch, samples keep their order in ``sample_ids``.
    Where the balanced spread does not fit that many micro-batches, FFD's packing is kept.

    ``groups`` (sample id -> group; prefix-shared packing): the spread places each group's
    samples here whole, onto the lightest micro-batch with room for all of them (members of a
    group that fits nowhere whole are placed one by one), so a group shares its prompt in one
    micro-batch; where that does not fit, the spread of single samples is tried next. Whole
    groups may need fewer micro-batches than FFD's count (fewer groups than micro-batches): the
    empty ones are dropped, so there are at most that many.

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
    units = [[i] for i in range(len(ids))]
    tries = [units]
    if groups is not None:
        members: dict[int, list[int]] = {}
        for i, s in enumerate(ids):
            members.setdefault(groups[s], []).append(i)
        tries.insert(0, list(members.values()))
    for attempt in tries:
        bins = _spread(attempt, cost, len(ffd), budget)
        if bins is not None:  # whole groups may leave a micro-batch empty: it is dropped
            return [[ids[i] for i in sorted(b)] for b in bins if b]
    return [[ids[i] for i in sorted(b)] for b in ffd]


def _spread(
    units: list[list[int]], cost: list[int], num_bins: int, budget: int
) -> list[list[int]] | None:
    """``units`` (lists of positions, ``cost`` each) spread largest-first onto the lightest of
    ``num_bins`` bins with room for the whole unit; a unit that fits nowhere whole is spread one
    position at a time. None when a single position fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins

    def place(unit: list[int]) -> bool:
        need = sum(cost[i] for i in unit)
        fits = [b for b in range(num_bins) if loads[b] + need <= budget]
        if not fits:
            return len(unit) > 1 and all(place([i]) for i in sorted(unit, key=lambda i: -cost[i]))
        b = min(fits, key=lambda b: (loads[b], b))
        bins[b].extend(unit)
        loads[b] += need
        return True

    for unit in sorted(units, key=lambda u: (-sum(cost[i] for i in u), u[0])):
        if not place(unit):
            return None
    return bins


def plan_micro_batches(
    sample_ids: Sequence[int],
    lengths: dict[int, int],
    cp: int,
    config: PlanConfig,
    consumer_cp: int | None = None,
    groups: dict[int, int] | None = None,
) -> list[list[list[int]]]:
    """One DP rank's mini-batches, each a list of micro-batches (sample ids): the one plan of
    what the consumer runs, so it consumes the dispatched micro-batches as they arrive.

    The samples are taken in first-fit-decreasing order at the destination's ``cp``
    (``pack_micro_batches``; an empty DP rank has none), mini-batch ``i`` holds every
    ``num_mini_batches``-th of them from the ``i``-th, and each mini-batch is balanced into
    micro-batches at ``consumer_cp`` (default ``cp``) under the same budget
    (``balance_micro_batches``; with one mini-batch at ``cp`` it reuses the packing above), a
    group's samples kept in one micro-batch where they fit with ``config.prefer_groups``
    (``groups``: sample id -> group, read only then)."""
    budget = config.max_tokens_per_micro_batch
    ffd = pack_micro_batches(sample_ids, lengths, cp, budget)
    order = [s for mb in ffd for s in mb]
    n = config.num_mini_batches
    consumer_cp = consumer_cp or cp
    # one mini-batch at the same cp: the FFD above is the one balancing needs (run it once)
    packed = ffd if n == 1 and consumer_cp == cp else None
    by_group = groups if config.prefer_groups else None
    return [
        balance_micro_batches(order[i::n], lengths, consumer_cp, budget, packed, by_group)
        for i in range(n)
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
        read = slice(None)
    else:  # the samples this view reads: its DP rank's and the ones it holds
        read = np.r_[np.flatnonzero(owner == own_dp), samples.rows(sources[rank].sample_ids)]
    read_ids = ids[read].tolist()
    lengths = dict(zip(read_ids, samples.length_array[read].tolist()))
    groups = (
        dict(zip(read_ids, samples.group_array[read].tolist())) if config.prefer_groups else None
    )
    minis = [
        plan_micro_batches(a, lengths, layout.cp, config, config.consumer_cp, groups)
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
        stages, own = route_rank(rank, sources, samples, owner, destination, schema, config)
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
