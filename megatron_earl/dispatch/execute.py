"""The dispatch executor: runs a plan's transfer stages over packed byte buffers, point to point.

    plan = plan_for(batch, Destination(layout, Phase.TRAIN), PlanConfig(...))  # 1 small all-gather
    local = execute(plan, batch)     # this rank's micro-batches (DP share, CP chunks, fields)
    back = return_results(plan, local, ["new_logprobs"])  # reverse.py: a Batch on each owner

Wire format: for each (stage, peer) one ``uint8`` buffer holding every field slice sent to that
peer, grouped by element size (8-byte dtypes first, then 4, 2, 1) so each slice is aligned and is
read back as a zero-copy view of its dtype. Both sides derive the layout of the buffer from the
plan: nothing but data travels. Transport ``"p2p"`` (default) posts one ``batch_isend_irecv``
per stage with only the non-empty peers; ``"all_to_all"`` uses ``all_to_all_single`` with uneven
splits. Both work on gloo (CPU) and NCCL.

Groups: the metadata all-gather (``plan_for``, and ``reverse.py``'s result specs) runs over the
host twin of ``group`` (``parallel.groups.host_group``: pickled objects, gloo); the payload over
``group`` itself, a device group, with buffers on the batch's device. Before the first batched p2p
on a group, ``parallel.groups.prepare_p2p`` runs one all-reduce over it (NCCL needs the first
batched p2p on a communicator to involve all its ranks).

Receivers pad CP chunks locally (``FieldSpec.pad_value``): padding never goes on the wire.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_earl.dispatch.balance import BalanceMemo
from megatron_earl.dispatch.batch import Batch, FieldSpec, Schema
from megatron_earl.dispatch.centralized import centralized_stages
from megatron_earl.dispatch.plan import DispatchPlan, cp_chunk_bounds, plan_dispatch
from megatron_earl.dispatch.route import DispatchError, Piece, Transfer
from megatron_earl.dispatch.spec import Destination, PlanConfig, SourceMeta
from megatron_earl.parallel.groups import host_group, prepare_p2p

TRANSPORTS = ("p2p", "all_to_all")


@dataclass
class MicroBatch:
    """One micro-batch as a destination rank holds it (packed, CP-local, this stage's fields)."""

    sample_ids: list[int]
    lengths: list[int]
    """Full (unpadded) sequence lengths."""
    local_lengths: list[int]
    """Tokens this rank holds per sample: ``cp_padded_length(len, cp) / cp`` (padding included)."""
    cp_bounds: list[tuple[tuple[int, int], tuple[int, int]]]
    """Per sample, the two position ranges (``cp_chunk_bounds``) of the local tokens."""
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token ``[sum(local_lengths), ...]``; per-sample ``[len(sample_ids), ...]``."""
    mini_batch: int = 0
    """The mini-batch (optimizer step) it belongs to (``PlanConfig.num_mini_batches``)."""

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative local lengths ``[0, l0, l0+l1, ...]`` (int32), for packed (thd) attention."""
        out = torch.zeros(len(self.local_lengths) + 1, dtype=torch.int32)
        out[1:] = torch.tensor(self.local_lengths, dtype=torch.int32).cumsum(0)
        return out


@dataclass
class DispatchedBatch:
    """What one destination rank received: its micro-batches (empty fields on middle PP stages)."""

    rank: int
    micro_batches: list[MicroBatch]

    def mini_batch(self, index: int) -> list[MicroBatch]:
        """The micro-batches of mini-batch ``index`` (in plan order; none on a rank without
        samples in it)."""
        return [mb for mb in self.micro_batches if mb.mini_batch == index]


class _Store:
    """Pieces a rank holds: token spans per (sample, field), per-sample rows per (sample, field)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        """Where buffers and padding are allocated (the batch's device)."""
        self.spans: dict[tuple[int, str], list[tuple[int, int, torch.Tensor]]] = defaultdict(list)
        self.rows: dict[tuple[int, str], torch.Tensor] = {}

    def put(self, piece: Piece, name: str, t: torch.Tensor) -> None:
        if piece.per_sample:
            self.rows[(piece.sample_id, name)] = t
        else:
            self.spans[(piece.sample_id, name)].append((piece.start, piece.end, t))

    def get(self, piece: Piece, name: str) -> torch.Tensor:
        if piece.per_sample:
            return self.rows[(piece.sample_id, name)]
        spans = self.spans[(piece.sample_id, name)]
        for a, b, t in spans:  # the common case: one span holds the piece
            if a <= piece.start and piece.end <= b:
                return t[piece.start - a : piece.end - a]
        parts, pos = [], piece.start
        for a, b, t in sorted(self.spans[(piece.sample_id, name)], key=lambda x: x[:2]):
            if a <= pos < b:
                end = min(b, piece.end)
                parts.append(t[pos - a : end - a])
                pos = end
            if pos == piece.end:
                break
        assert pos == piece.end, f"store misses {piece} field {name} (internal plan error)"
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @classmethod
    def from_batch(cls, batch: Batch) -> _Store:
        tensors = [*batch.token_fields.values(), *batch.sample_fields.values()]
        store = cls(tensors[0].device if tensors else None)
        for i, sid in enumerate(batch.sample_ids):
            a, b = batch.offsets[i], batch.offsets[i + 1]
            for name, t in batch.token_fields.items():
                store.put(Piece(sid, 0, b - a, ()), name, t[a:b])
            for name, t in batch.sample_fields.items():
                store.put(Piece(sid, -1, -1, ()), name, t[i])
        return store


# ---------------------------------------------------------------------- metadata and planning


class PlanCache:
    """Plans keyed by the exact inputs of every rank (after the metadata all-gather), so a dispatch
    whose inputs repeat (the same batch to the same layout and config, e.g. a phase re-run after
    an OOM, or phases that share a layout and fields) skips planning. The key is every rank's
    sample ids, lengths and groups, the schema, the destination, the config, the group and this
    rank: a plan is never reused for inputs that differ in any of them. Least recently used
    plans are dropped beyond ``size``. A plan it does compute balances through ``balances``
    (``BalanceMemo``), so the same batch to another destination of the same dp (the experience
    and train phases of a step) reuses the balance."""

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise DispatchError(f"PlanCache size={size}; use >= 1")
        self.size = size
        self.plans: OrderedDict[tuple, DispatchPlan] = OrderedDict()
        self.balances = BalanceMemo(size)
        """Balances shared by this cache's plans."""
        self.hits = 0
        """Plans served from the cache."""
        self.misses = 0
        """Plans computed."""

    def lookup(self, key: tuple, make: Callable[[], DispatchPlan]) -> DispatchPlan:
        if key in self.plans:
            self.hits += 1
            self.plans.move_to_end(key)
            return self.plans[key]
        self.misses += 1
        plan = self.plans[key] = make()
        while len(self.plans) > self.size:
            self.plans.popitem(last=False)
        return plan


def plan_for(
    batch: Batch,
    destination: Destination,
    config: PlanConfig | None = None,
    group: dist.ProcessGroup | None = None,
    cache: PlanCache | None = None,
    whole: bool = False,
    routed: bool = True,
) -> DispatchPlan:
    """All-gather every rank's sample metadata and plan this rank's view of the dispatch (what it
    sends and receives; ``whole=True``: the whole plan, as in tests).

    Metadata: one int64 tensor per rank (``[ids | lengths | groups]``, padded to the largest
    rank's count) after a two-int header (sample count, a digest of schema, destination and
    config); only when digests differ are the full values all-gathered to name the difference.
    ``cache``: reuse the plan when every rank's inputs equal a cached plan's (``PlanCache``).
    ``routed=False``: no decentralized stages (enough for ``execute(..., centralized=True)``).

    Which ranks call: every rank of ``group`` (default: the world), with the same destination and
    config; the all-gathers run on ``group``'s host twin. Mismatched schemas, destinations or
    configs, and every planning error, raise the same error on every rank."""
    config = config or PlanConfig()
    hg = host_group(group)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    inputs = (batch.schema, repr(destination), repr(config))
    digest = int.from_bytes(
        hashlib.blake2b(repr(inputs).encode(), digest_size=8).digest(), "little", signed=True
    )
    head = torch.tensor([batch.num_samples, digest], dtype=torch.int64)
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head, group=hg)
    counts = [int(h[0]) for h in heads]
    if any(int(h[1]) != digest for h in heads):
        _disagreement((batch.schema, repr(destination), repr(config)), group)
    m = max(1, *counts)
    body = torch.zeros(3 * m, dtype=torch.int64)
    n = batch.num_samples
    body[:n] = torch.tensor(batch.sample_ids, dtype=torch.int64)
    body[m : m + n] = torch.tensor(batch.lengths, dtype=torch.int64)
    body[2 * m : 2 * m + n] = torch.tensor(batch.group_ids, dtype=torch.int64)
    bodies = [torch.empty_like(body) for _ in range(world)]
    dist.all_gather(bodies, body, group=hg)
    table = torch.stack(bodies).numpy()
    ranks = None if group is None else tuple(dist.get_process_group_ranks(group))
    key = (inputs, ranks, None if whole else me, routed, tuple(counts), table.tobytes())

    def make() -> DispatchPlan:
        sources = [
            SourceMeta(
                tuple(t[:c].tolist()),
                tuple(t[m : m + c].tolist()),
                tuple(t[2 * m : 2 * m + c].tolist()),
            )
            for t, c in zip(table, counts)
        ]
        rank = None if whole else me
        balances = None if cache is None else cache.balances
        return plan_dispatch(
            sources, batch.schema, destination, config, rank, routed, balances=balances
        )

    return make() if cache is None else cache.lookup(key, make)


def _disagreement(values: tuple, group: dist.ProcessGroup | None) -> None:
    """Raise naming what ranks disagree on (schema, destination or config), from the full
    values all-gathered. Which ranks call: every rank of ``group`` (all saw differing digests)."""
    gathered = _all_gather(values, group)
    for what, i in (("batch schema", 0), ("destination", 1), ("plan config", 2)):
        got = [g[i] for g in gathered]
        if any(v != got[0] for v in got):
            differ = [r for r, v in enumerate(got) if v != got[0]]
            raise DispatchError(
                f"ranks disagree on the {what}: rank 0 has {_short(got[0])}, ranks {differ} "
                f"differ (rank {differ[0]}: {_short(got[differ[0]])}); pass the same everywhere"
            )
    raise DispatchError("ranks' plan inputs hash differently but compare equal (internal error)")


def _short(v: object) -> str:
    if isinstance(v, tuple) and v and isinstance(v[0], FieldSpec):
        return str(
            [(s.name, str(s.dtype).replace("torch.", ""), s.per_token, s.trailing) for s in v]
        )
    return str(v)


def _all_gather(obj: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``obj`` (small metadata), over the host twin of device group ``group``.
    Which ranks call: every rank of ``group``."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=host_group(group))
    return out


# ---------------------------------------------------------------------- running stages


def run_stages(
    stages: Sequence[Sequence[Transfer]],
    schema: Schema,
    store: _Store,
    transport: str = "p2p",
    group: dist.ProcessGroup | None = None,
) -> None:
    """Execute ``stages`` in order, adding what this rank receives to ``store``.

    Which ranks call: every rank of ``group`` (a device group) with the same stages (p2p: ranks
    with nothing to send or receive post nothing, after ``prepare_p2p``; all_to_all: every rank
    takes part in every stage)."""
    if transport not in TRANSPORTS:
        raise DispatchError(f"transport={transport!r}; valid: {TRANSPORTS}")
    if transport == "p2p":
        prepare_p2p(group)
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    specs = {s.name: s for s in schema}
    for stage in stages:
        outgoing: dict[int, list[Transfer]] = defaultdict(list)
        incoming: dict[int, list[Transfer]] = defaultdict(list)
        for t in stage:
            if t.src == me and t.dst == me:
                for name in t.piece.fields:
                    store.put(t.piece, name, store.get(t.piece, name))
            elif t.src == me:
                outgoing[t.dst].append(t)
            elif t.dst == me:
                incoming[t.src].append(t)
        sends = {d: _pack(ts, specs, store) for d, ts in outgoing.items()}
        layouts = {s: _layout(ts, specs) for s, ts in incoming.items()}
        recvs = {
            s: torch.empty(sum(n for *_, n in lay), dtype=torch.uint8, device=store.device)
            for s, lay in layouts.items()
        }
        if transport == "p2p":
            exchange_p2p(sends, recvs, group)
        else:
            _exchange_all_to_all(sends, recvs, world, group, store.device)
        for s, buf in recvs.items():
            _unpack(buf, layouts[s], specs, store)


def _layout(
    transfers: list[Transfer], specs: dict[str, FieldSpec]
) -> list[tuple[Transfer, str, int]]:
    """(transfer, field, nbytes) in buffer order: grouped by dtype, larger elements first (so every
    group starts aligned), plan order within a group."""
    groups: dict[tuple[int, str], set[str]] = defaultdict(set)
    for name, spec in specs.items():
        groups[_dtype_key(spec.dtype)].add(name)
    row_bytes = {name: spec.row_bytes for name, spec in specs.items()}
    out = []
    for key in sorted(groups):
        names = groups[key]
        for t in transfers:
            p = t.piece
            rows = 1 if p.start < 0 else p.end - p.start
            out += [(t, name, rows * row_bytes[name]) for name in p.fields if name in names]
    return out


def _dtype_key(dtype: torch.dtype) -> tuple[int, str]:
    return -dtype.itemsize, str(dtype)


def _pack(transfers: list[Transfer], specs: dict[str, FieldSpec], store: _Store) -> torch.Tensor:
    """One uint8 buffer; each dtype group is written by one native-dtype ``cat`` into its segment
    (a byte-wise cat is ~10x slower on CPU)."""
    layout = _layout(transfers, specs)
    buf = torch.empty(sum(n for *_, n in layout), dtype=torch.uint8, device=store.device)
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t, name, _ in layout:
        groups[specs[name].dtype].append(store.get(t.piece, name).reshape(-1))
    pos = 0
    for dtype in sorted(groups, key=_dtype_key):
        n = sum(p.numel() for p in groups[dtype])
        nbytes = n * dtype.itemsize
        torch.cat(groups[dtype], out=buf[pos : pos + nbytes].view(dtype))
        pos += nbytes
    return buf


def _unpack(
    buf: torch.Tensor,
    layout: list[tuple[Transfer, str, int]],
    specs: dict[str, FieldSpec],
    store: _Store,
) -> None:
    """Put the slices of ``buf`` (laid out as ``_layout`` says) into ``store`` as views."""
    pos, view, view_dtype, view_pos = 0, buf, None, 0
    for t, name, n in layout:
        s = specs[name]
        if s.dtype != view_dtype:  # a new dtype group: view the rest of the buffer once
            view_dtype, view_pos = s.dtype, 0
            rest = buf[pos:]
            view = rest[: rest.numel() // s.dtype.itemsize * s.dtype.itemsize].view(s.dtype)
        count = n // s.dtype.itemsize
        shape = s.trailing if t.piece.per_sample else (t.piece.end - t.piece.start, *s.trailing)
        store.put(t.piece, name, view[view_pos : view_pos + count].view(shape))
        view_pos += count
        pos += n


def exchange_p2p(
    sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    """Send ``sends[peer]`` to and receive into ``recvs[peer]`` from each peer (ranks of
    ``group``, a device group) with one ``batch_isend_irecv``; waits for all. Point to point:
    each rank calls it with its own peers; every message must be matched by the peer's call (same
    size). Every rank of ``group`` must have called ``parallel.groups.prepare_p2p(group)`` first
    (``run_stages`` and ``weight_exec.execute_plan`` do)."""

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    ops = [dist.P2POp(dist.irecv, buf, peer(s), group) for s, buf in sorted(recvs.items())]
    ops += [dist.P2POp(dist.isend, buf, peer(d), group) for d, buf in sorted(sends.items())]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _exchange_all_to_all(
    sends: dict[int, torch.Tensor],
    recvs: dict[int, torch.Tensor],
    world: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    # each peer's part is padded to 8 bytes so every part (and slice in it) stays aligned
    def padded(n: int) -> int:
        return -(-n // 8) * 8

    recv_sizes = [padded(recvs[r].numel()) if r in recvs else 0 for r in range(world)]
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    send_parts = []
    for r in range(world):
        buf = sends.get(r, out[:0])
        send_parts.append(torch.nn.functional.pad(buf, (0, padded(buf.numel()) - buf.numel())))
    dist.all_to_all_single(
        out,
        torch.cat(send_parts),
        output_split_sizes=recv_sizes,
        input_split_sizes=[p.numel() for p in send_parts],
        group=group,
    )
    for r, part in zip(range(world), out.split(recv_sizes)):
        if r in recvs:
            recvs[r] = part[: recvs[r].numel()]


def simulate(
    stages: Sequence[Sequence[Transfer]], schema: Schema, stores: dict[int, _Store]
) -> None:
    """Run ``stages`` in one process over per-rank stores, through the same pack/unpack as the
    wire (for tests without processes). Calls no collective."""
    specs = {s.name: s for s in schema}
    for stage in stages:
        moves: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        for t in stage:
            moves[(t.src, t.dst)].append(t)
        packed = {k: _pack(ts, specs, stores[k[0]]) for k, ts in moves.items() if k[0] != k[1]}
        for (src, dst), ts in moves.items():
            if src == dst:
                for t in ts:
                    for name in t.piece.fields:
                        stores[dst].put(t.piece, name, stores[dst].get(t.piece, name))
            else:
                store = stores.setdefault(dst, _Store())
                _unpack(packed[(src, dst)], _layout(ts, specs), specs, store)


# ---------------------------------------------------------------------- forward


def execute(
    plan: DispatchPlan,
    batch: Batch,
    transport: str = "p2p",
    centralized: bool = False,
    group: dist.ProcessGroup | None = None,
) -> DispatchedBatch:
    """Run ``plan`` from this rank's ``batch``; return this rank's micro-batches.

    Which ranks call: every rank of ``group``, each with the batch it described in ``plan_for``.
    ``centralized=True`` runs the single-controller baseline (``centralized_stages``) instead:
    same result, used by tests and the benchmark."""
    me = dist.get_rank(group)
    if plan.rank not in (None, me):
        raise DispatchError(f"execute on rank {me} with rank {plan.rank}'s view of the plan")
    if not centralized and not plan.stages:
        raise DispatchError("the plan has no stages (planned with routed=False): plan it routed")
    store = _Store.from_batch(batch)
    stages = centralized_stages(plan) if centralized else plan.stages
    run_stages(stages, plan.schema, store, transport, group)
    return assemble(plan, store, dist.get_rank(group))


def assemble(plan: DispatchPlan, store: _Store, rank: int) -> DispatchedBatch:
    """This rank's micro-batches from the pieces in ``store`` (CP padding filled locally)."""
    layout = plan.destination.layout
    c = layout.coord(rank)
    names = plan.destination.stage_fields(plan.schema, c.pp)
    specs = [s for s in plan.schema if s.name in names]
    out = []
    minis = [j for j, n in enumerate(plan.mini_batch_sizes[c.dp]) for _ in range(n)]
    for mb, mini in zip(plan.micro_batches[c.dp], minis, strict=True):
        lengths = [plan.samples[s].length for s in mb]
        bounds = [cp_chunk_bounds(n, layout.cp, c.cp) for n in lengths]
        # per chunk: the real tokens' piece (None if all padding) and the padding after them
        segments = []
        for sid, n, chunks in zip(mb, lengths, bounds):
            for a, b in chunks:
                real = Piece(sid, a, min(b, n), ()) if min(b, n) > a else None
                segments.append((real, b - max(a, n) if b > max(a, n) else 0))
        max_pad = max((pad for _, pad in segments), default=0)
        fields = {}
        for s in specs:
            if s.per_token:
                fill = None
                if max_pad:  # one padding tensor per field; chunks take views of it
                    shape = (max_pad, *s.trailing)
                    fill = torch.full(shape, s.pad_value, dtype=s.dtype, device=store.device)
                parts = []
                for real, pad in segments:
                    if real is not None:
                        parts.append(store.get(real, s.name))
                    if pad:
                        parts.append(fill[:pad])
                fields[s.name] = torch.cat(parts)
            else:
                fields[s.name] = torch.stack(
                    [store.get(Piece(sid, -1, -1, ()), s.name) for sid in mb]
                )
        local = [sum(b - a for a, b in chunks) for chunks in bounds]
        out.append(MicroBatch(list(mb), lengths, local, bounds, fields, mini))
    return DispatchedBatch(rank, out)
