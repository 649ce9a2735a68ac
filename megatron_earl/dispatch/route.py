"""Routing (pure): from who holds which pieces and who needs which, the point-to-point transfers.

A ``Piece`` is a token span ``[start, end)`` of one sample for some per-token fields, or (``start ==
end == -1``) the per-sample fields of a sample. ``route`` covers every needed piece from the
holders:

- a needed span may be served by several holders (e.g. the CP chunks of a different layout): it is
  cut at the holders' span boundaries;
- among holders of a span, the source is the consumer itself (a local copy), else a holder on a
  consumer's node; replicas tied on that (e.g. the TP ranks of a rollout engine) take turns by
  ``(sample_id + start) % len(tied)``, so they share the sending. The choice depends on the piece
  and its holders and consumers only (no state carried between pieces): a rank can route just the
  pieces it sends or receives and get the same transfers as the whole plan (``plan.py``);
- TP fan-out: the ranks of one TP group need identical pieces. With ``fanout="node_relay"``
  (default) a piece crosses to another node once and is copied on inside that node (stage 2,
  over NVLink); consumers on the source's own node get it directly. ``fanout="direct"`` sends
  every consumer its own copy in one stage. See docs/dispatch.md for why.

The result is a list of stages; stage ``k + 1`` may forward what stage ``k`` delivered.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megatron_earl.config.vocab import Fanout
from megatron_earl.dispatch.batch import Schema


class DispatchError(ValueError):
    """A batch/destination pair the dispatcher cannot serve; raised on all ranks before any send."""


class Piece(NamedTuple):
    """A span of one sample for some fields (``start == end == -1``: per-sample fields).

    A named tuple rather than a dataclass: plans and the executor build, hash and compare tens of
    thousands of them, and a tuple does that in C (ordered by sample_id, start, end, fields)."""

    sample_id: int
    start: int
    end: int
    fields: tuple[str, ...]

    @property
    def per_sample(self) -> bool:
        return self.start < 0


class Transfer(NamedTuple):
    """``src`` sends ``dst`` the piece (``src == dst``: a local copy, no communication)."""

    src: int
    dst: int
    piece: Piece

    def nbytes(self, row_bytes: dict[str, int]) -> int:
        rows = 1 if self.piece.per_sample else self.piece.end - self.piece.start
        return rows * sum(row_bytes[f] for f in self.piece.fields)


@dataclass(frozen=True)
class RouteConfig:
    """Source choice and fan-out policy."""

    fanout: Fanout = Fanout.NODE_RELAY
    """"node_relay": one copy per remote node, forwarded inside it; "direct": one copy per rank."""
    ranks_per_node: int | None = None
    """Consecutive ranks sharing a node (fast intra-node links); None = all ranks on one node."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "fanout", Fanout(self.fanout))
        except ValueError:
            raise DispatchError(f"fanout={self.fanout!r}; valid: {tuple(Fanout)}") from None
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise DispatchError(f"ranks_per_node={self.ranks_per_node}; use >= 1 or None")

    @property
    def relays(self) -> bool:
        """Whether a remote node gets one copy that a leader forwards inside it (node_relay with
        known nodes)."""
        return self.fanout == Fanout.NODE_RELAY and self.ranks_per_node is not None

    def node(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node


def route(
    holdings: dict[int, list[Piece]],
    needs: dict[int, list[Piece]],
    schema: Schema,
    config: RouteConfig,
) -> list[list[Transfer]]:
    """Transfers (in stages) that give every rank in ``needs`` exactly its pieces.

    Raises ``DispatchError`` naming the sample, span and field when no rank holds a needed piece."""
    consumers: dict[Piece, list[int]] = defaultdict(list)
    for rank in sorted(needs):
        for p in needs[rank]:
            consumers[p].append(rank)
    held: dict[int, list[tuple[int, Piece]]] = defaultdict(list)
    for rank in sorted(holdings):
        for p in holdings[rank]:
            held[p.sample_id].append((rank, p))

    stages: list[list[Transfer]] = [[], []]
    for piece in sorted(consumers, key=lambda p: (p.sample_id, p.start, p.end, p.fields)):
        dsts = consumers[piece]
        for part, cands in _cover(piece, held[piece.sample_id]):
            src = choose_source(cands, dsts, part, config)
            for stage, t in fan_out(src, dsts, part, config):
                stages[stage].append(t)
    return [s for s in stages if s]  # deterministic: built in sorted piece order


def _cover(piece: Piece, holders: list[tuple[int, Piece]]) -> list[tuple[Piece, list[int]]]:
    """Cut ``piece`` into parts, each with the ranks holding all of its fields over all of it."""
    out: list[tuple[Piece, list[int]]] = []
    if piece.per_sample:
        segments = [(-1, -1)]
    else:
        cuts = {piece.start, piece.end}
        for _, h in holders:
            if not h.per_sample:
                cuts |= {c for c in (h.start, h.end) if piece.start < c < piece.end}
        points = sorted(cuts)
        segments = list(itertools.pairwise(points))
    per_sample = piece.per_sample
    for a, b in segments:
        covering = [
            (r, h.fields)
            for r, h in holders
            if h.per_sample == per_sample and (per_sample or (h.start <= a and b <= h.end))
        ]
        wanted = set(piece.fields)
        full = tuple(sorted({r for r, fields in covering if wanted <= set(fields)}))
        by_cands: dict[tuple[int, ...], list[str]] = defaultdict(list)
        if full:  # the common case: some holders have every field
            by_cands[full] = list(piece.fields)
        for f in () if full else piece.fields:
            cands = tuple(sorted({r for r, fields in covering if f in fields}))
            if not cands:
                where = "per-sample" if per_sample else f"tokens [{a}, {b})"
                raise DispatchError(
                    f"sample {piece.sample_id} field {f!r} ({where}) is held by no rank; holders "
                    f"of this sample: {sorted({r for r, _ in holders}) or 'none'}"
                )
            by_cands[cands].append(f)
        for cands, fields in sorted(by_cands.items()):
            part = Piece(piece.sample_id, a, b, tuple(fields))
            if out and out[-1][1] == list(cands) and _joinable(out[-1][0], part):
                prev = out[-1][0]
                out[-1] = (Piece(prev.sample_id, prev.start, b, prev.fields), list(cands))
            else:
                out.append((part, list(cands)))
    return out


def _joinable(a: Piece, b: Piece) -> bool:
    return not a.per_sample and a.fields == b.fields and a.end == b.start


def choose_source(
    cands: Sequence[int], dsts: Sequence[int], part: Piece, config: RouteConfig
) -> int:
    """The holder (of ``cands``, ascending) that sends ``part`` to ``dsts``: a consumer itself,
    else one on a consumer's node; ties take turns by ``(sample_id + start) % len(tied)``."""
    if len(cands) == 1:
        return cands[0]
    dst_nodes = {config.node(d) for d in dsts}
    rank = {r: (r not in dsts, config.node(r) not in dst_nodes) for r in cands}
    best = min(rank.values())
    tied = [r for r in cands if rank[r] == best]
    return tied[(part.sample_id + max(part.start, 0)) % len(tied)]


def fan_out(
    src: int, dsts: Sequence[int], part: Piece, config: RouteConfig
) -> list[tuple[int, Transfer]]:
    """(stage, transfer) pairs giving ``part`` from ``src`` to every rank of ``dsts`` (ascending):
    stage 0 direct or to a node's leader (``dsts[sample_id % n]`` of that node's consumers), stage
    1 from the leader to the rest of its node (``node_relay``)."""
    by_node: dict[int, list[int]] = defaultdict(list)
    for d in dsts:
        by_node[config.node(d)].append(d)
    out = []
    for node, group in sorted(by_node.items()):
        if config.fanout == Fanout.DIRECT or node == config.node(src) or len(group) == 1:
            out += [(0, Transfer(src, d, part)) for d in group]
            continue
        leader = group[part.sample_id % len(group)]
        out.append((0, Transfer(src, leader, part)))
        out += [(1, Transfer(leader, d, part)) for d in group if d != leader]
    return out
