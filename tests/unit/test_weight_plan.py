"""The weight reshard planner on fake piece metadata (no processes): every ordered pair of layouts
of 2 and 4 ranks, several bucket bounds. Checks: every destination element is covered exactly
once, only regions the source ranks hold are read, local copies are taken whenever the
destination rank holds the data, each rank's buffers per round stay within the bucket bound,
messages are well formed, the plan is deterministic and load is spread over replicas.

The fake metadata mirrors what Megatron's ``sharded_state_dict()`` gives (see geometry.py): TP
splits along dim 0 (embedding, QKV, fc1 gate and up as two pieces) or dim 1 (proj, fc2), layers
stacked along a prepended axis and split across pipeline stages (interleaved with vpp), replicas
across DP and CP, and tied embeddings held again by the last stage.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.redistribute.geometry import intersect, region_numel, relative
from megatron_earl.redistribute.weight_plan import (
    ALIGN,
    PieceMeta,
    WeightPlanError,
    plan_summary,
    plan_weights,
    split_box,
)

L, H, Q, F, V, ITEM = 4, 8, 12, 8, 16, 4
"""Layers, hidden, fused QKV rows, ffn (per gate/up branch), padded vocab, bytes per element."""


def fake_metas(layout: ParallelLayout, tied: bool) -> list[list[PieceMeta]]:
    """Per-rank piece metadata of a tiny GQA model with QKV bias in ``layout``."""
    return [_rank_metas(layout, rank, tied) for rank in range(layout.world_size)]


def _rank_metas(layout: ParallelLayout, rank: int, tied: bool) -> list[PieceMeta]:
    c = layout.coord(rank)
    vpp = layout.vpp or 1
    metas: list[PieceMeta] = []

    def add(key, shape, region):
        metas.append(PieceMeta(key, shape, tuple(region), ITEM))

    def tp_rows(n):
        return (c.tp * n // layout.tp, (c.tp + 1) * n // layout.tp)

    first, last = c.pp == 0, c.pp == layout.pp - 1
    if first:
        add("emb", (V, H), [tp_rows(V), (0, H)])
    per_chunk = L // (layout.pp * vpp)
    for chunk in range(vpp):
        start = (chunk * layout.pp + c.pp) * per_chunk
        for layer in range(start, start + per_chunk):
            lay = (layer, layer + 1)
            add("ln1", (L, H), [lay, (0, H)])
            add("qkv.w", (L, Q, H), [lay, tp_rows(Q), (0, H)])
            add("qkv.b", (L, Q), [lay, tp_rows(Q)])
            add("proj", (L, H, H), [lay, (0, H), tp_rows(H)])
            add("ln2", (L, H), [lay, (0, H)])
            gate = tp_rows(F)
            add("fc1", (L, 2 * F, H), [lay, gate, (0, H)])
            add("fc1", (L, 2 * F, H), [lay, (F + gate[0], F + gate[1]), (0, H)])
            add("fc2", (L, H, F), [lay, (0, H), tp_rows(F)])
    if last:
        add("final_ln", (H,), [(0, H)])
        if not tied:
            add("out", (V, H), [tp_rows(V), (0, H)])
        elif not first:
            add("emb", (V, H), [tp_rows(V), (0, H)])
    return metas


def layouts(world: int) -> list[ParallelLayout]:
    found = []
    for tp, cp, pp in itertools.product((1, 2, 4), repeat=3):
        if world % (tp * cp * pp) or tp * cp * pp > world:
            continue
        dp = world // (tp * cp * pp)
        found.append(ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp))
        if pp >= 2 and L % (pp * 2) == 0:
            found.append(ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp, vpp=2))
    return found


BUCKETS = [ALIGN, 100, 1024, 1 << 20]
BUCKETS_4 = [64, 100, 1024, 1 << 20]
# World 2: every ordered pair x every bucket x tied/untied. World 4 (156 ordered pairs): every pair
# tied and untied, the bucket bound cycling over BUCKETS_4 so each bound meets many pairs (64 B
# still splits rows; the sub-row split at ALIGN is covered on 2 ranks).
CASES = [
    (a, b, bucket, tied)
    for a, b in itertools.product(layouts(2), repeat=2)
    for bucket in BUCKETS
    for tied in (False, True)
] + [
    (a, b, BUCKETS_4[(i + 2 * tied) % len(BUCKETS_4)], tied)
    for i, (a, b) in enumerate(itertools.product(layouts(4), repeat=2))
    for tied in (False, True)
]


def check_plan(plan, src, dst, bucket):
    """Every invariant the executor relies on."""
    covered = {
        (r, i): np.zeros([b - a for a, b in m.region], dtype=np.int32)
        for r, metas in enumerate(dst)
        for i, m in enumerate(metas)
    }
    transfers = list(plan.local) + [t for rnd in plan.rounds for t in rnd]
    for t in transfers:
        s, d = src[t.src_rank][t.src_index], dst[t.dst_rank][t.dst_index]
        assert s.key == d.key == t.key
        # Only regions that exist on the source rank are read.
        assert intersect(t.region, s.region) == t.region, (t, s)
        assert t.src_region == relative(t.region, s.region)
        assert t.dst_region == relative(t.region, d.region)
        assert t.nbytes == region_numel(t.region) * ITEM
        covered[(t.dst_rank, t.dst_index)][tuple(slice(a, b) for a, b in t.dst_region)] += 1
    for where, count in covered.items():
        assert (count == 1).all(), f"destination piece {where} covered {count.min()}..{count.max()}"
    assert all(t.src_rank == t.dst_rank for t in plan.local)
    held = {}
    for rank, metas in enumerate(src):
        for m in metas:
            held.setdefault((rank, m.key), []).append(m.region)
    for rnd_index, rnd in enumerate(plan.rounds):
        assert rnd, "empty round"
        for t in rnd:
            assert t.src_rank != t.dst_rank
            # Local copies preferred: the destination rank holds no source piece with this box.
            assert not any(
                intersect(r, t.region) == t.region for r in held.get((t.dst_rank, t.key), ())
            ), t
            assert t.offset % ALIGN == 0
        for rank in range(plan.world_size):
            assert plan.round_buffer_bytes(rnd_index, rank) <= bucket
        # Messages: transfers of one (src, dst) pair tile the message without overlap.
        pairs = {}
        for t in rnd:
            pairs.setdefault((t.src_rank, t.dst_rank), []).append(t)
        for ts in pairs.values():
            end = 0
            for t in ts:
                assert t.offset == end
                end += t.padded_nbytes
    total_sent = sum(plan.bytes_sent(r) for r in range(plan.world_size))
    assert total_sent == sum(plan.bytes_received(r) for r in range(plan.world_size))


@pytest.mark.parametrize(
    "a,b,bucket,tied",
    CASES,
    ids=[f"{a}->{b}-{bucket}B-{'tied' if t else 'untied'}" for a, b, bucket, t in CASES],
)
def test_plan_invariants(a, b, bucket, tied):
    src, dst = fake_metas(a, tied), fake_metas(b, tied)
    plan = plan_weights(src, dst, bucket)
    check_plan(plan, src, dst, bucket)
    assert plan == plan_weights(src, dst, bucket)  # deterministic: same on every rank


def test_same_layout_is_all_local():
    layout = ParallelLayout(tp=2, pp=2)
    metas = fake_metas(layout, tied=True)
    plan = plan_weights(metas, metas, 64)
    assert plan.rounds == ()
    assert sum(plan.bytes_local(r) for r in range(4)) == sum(m.nbytes for ms in metas for m in ms)


def test_replica_load_is_balanced():
    # tp2dp2 -> dp4: every rank needs the other TP half, which two ranks hold.
    src = fake_metas(ParallelLayout(tp=2, dp=2), tied=False)
    dst = fake_metas(ParallelLayout(dp=4), tied=False)
    plan = plan_weights(src, dst, 1 << 20)
    sent = [plan.bytes_sent(r) for r in range(4)]
    largest = max(m.nbytes for ms in src for m in ms)
    assert max(sent) - min(sent) <= largest, sent
    summary = plan_summary(plan)
    assert summary["sent_max"] == max(sent) and summary["recv_max"] == summary["recv_mean"]


def test_no_rank_receives_more_than_it_needs():
    # pp2 -> tp2: each rank receives only the half-layers it lacks, never the full model.
    src = fake_metas(ParallelLayout(pp=2), tied=False)
    dst = fake_metas(ParallelLayout(tp=2), tied=False)
    plan = plan_weights(src, dst, 1 << 20)
    for rank in range(2):
        need = sum(m.nbytes for m in dst[rank])
        assert plan.bytes_received(rank) + plan.bytes_local(rank) == need


@pytest.mark.parametrize(
    "box,max_bytes",
    [
        (((0, 5), (0, 3)), 4),
        (((0, 5), (0, 3)), 12),
        (((0, 5), (0, 3)), 28),
        (((2, 4), (1, 7), (3, 6)), 8),
        (((0, 3),), 1000),
        ((), 4),
    ],
)
def test_split_box_tiles_the_box(box, max_bytes):
    parts = split_box(box, 4, max_bytes)
    shape = [b - a for a, b in box]
    count = np.zeros(shape, dtype=np.int32)
    for part in parts:
        assert region_numel(part) * 4 <= max_bytes
        count[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(part, box))] += 1
    assert (count == 1).all()


def test_errors_name_the_problem():
    src = fake_metas(ParallelLayout(tp=2), tied=False)
    dst = fake_metas(ParallelLayout(dp=2), tied=False)
    with pytest.raises(WeightPlanError, match="bucket_bytes"):
        plan_weights(src, dst, ALIGN - 1)
    with pytest.raises(WeightPlanError, match="2 source ranks but 1"):
        plan_weights(src, dst[:1], 1024)
    missing = [[m for m in ms if m.key != "out"] for ms in src]
    with pytest.raises(WeightPlanError, match=r"'out'.*no source rank"):
        plan_weights(missing, dst, 1024)
    bigger = [[PieceMeta("x", (8,), ((0, 8),), 4)], [PieceMeta("x", (8,), ((0, 8),), 4)]]
    other = [[PieceMeta("x", (9,), ((0, 9),), 4)], []]
    with pytest.raises(WeightPlanError, match="global shape"):
        plan_weights(bigger, other, 1024)
    overlap = [[PieceMeta("x", (8,), ((0, 5),), 4)], [PieceMeta("x", (8,), ((3, 8),), 4)]]
    with pytest.raises(WeightPlanError, match="overlap"):
        plan_weights(overlap, bigger, 1024)
    holes = [[PieceMeta("x", (8,), ((0, 4),), 4)], []]
    with pytest.raises(WeightPlanError, match="only covered for 4 of 8"):
        plan_weights(holes, bigger, 1024)
    with pytest.raises(WeightPlanError, match="not a non-empty box"):
        PieceMeta("x", (8,), ((4, 9),), 4)
