"""The reshard plan cache (``redistribute/plan_cache.py``): a repeated reshard reuses its plan, and
any changed input -- layout pair, parameter set, names, shapes, dtypes, bucket, process group, or
one rank's pieces alone -- plans afresh on every rank, never reusing a stale plan.

One run of 2 gloo processes builds tiny models once (every variant in dp2 and tp2, the base model
in pp2 too), loads each directly with deterministic reference weights, then plays one scenario per
input with its own ``PlanCache``: each reshard poisons the destination with NaN first and must
leave it **bitwise** equal to its directly loaded weights; the scenario records, per call, whether
the plan came from the cache. The tests below read that shared record. Tolerance: none (bitwise).
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

BUCKET_BYTES = 4096
BASE = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=60,
    make_vocab_size_divisible_by=16,
    add_qkv_bias=True,
)
MODELS = {
    "base": BASE,
    "no_bias": dataclasses.replace(BASE, add_qkv_bias=False),
    "wider": dataclasses.replace(BASE, ffn_hidden_size=64),
    "bf16": dataclasses.replace(BASE, params_dtype="bfloat16"),
    "fp16": dataclasses.replace(BASE, params_dtype="float16"),
}
DP2, TP2, PP2 = ParallelLayout(dp=2), ParallelLayout(tp=2), ParallelLayout(pp=2)


def _reference(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _scenarios() -> dict:
    """Every rank: build the models, play every scenario; per scenario the cached flags of its
    calls, in order, and its cache's stats."""
    import torch.distributed as dist

    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.groups import group_cache
    from megatron_earl.parallel.state import use_layout
    from megatron_earl.redistribute.geometry import load_full_state_dict, shard_pieces
    from megatron_earl.redistribute.plan_cache import PLAN_CACHE, PlanCache, gather_and_plan
    from megatron_earl.redistribute.weight_exec import reshard_weights

    built = {}

    def build(name: str, layout: ParallelLayout, tag: str = ""):
        use_layout(layout)
        runtime.seed(7)
        chunks = build_model(MODELS[name], vpp=layout.vpp)
        pieces = shard_pieces(chunks)
        load_full_state_dict(chunks, {p.key: _reference(p.key, p.global_shape) for p in pieces})
        built[(name, str(layout) + tag)] = (pieces, [p.local.clone() for p in pieces])

    for name in MODELS:
        build(name, DP2)
        build(name, TP2)
    build("base", PP2)
    build("base", DP2, "copy")

    def move(src, dst, cache, **kwargs) -> bool:
        """Poison ``dst``, reshard, check bitwise; whether the plan was cached."""
        (src_pieces, _), (dst_pieces, want) = src, dst
        with torch.no_grad():
            for p in dst_pieces:
                p.local.fill_(float("nan"))
        stats = reshard_weights(src_pieces, dst_pieces, cache=cache, **kwargs)
        for p, w in zip(dst_pieces, want, strict=True):
            if not torch.equal(_bits(p.local), _bits(w)):
                raise AssertionError(f"{p.param_name} ({p.key} {p.region}) differs")
        return stats.plan_cached

    def get(name, layout, tag=""):
        return built[(name, str(layout) + tag)]

    out = {}
    base_dp2, base_tp2, base_pp2 = get("base", DP2), get("base", TP2), get("base", PP2)

    cache = PlanCache()
    flags = [move(base_dp2, base_tp2, cache, bucket_bytes=BUCKET_BYTES) for _ in range(3)]
    cached_plan, _ = cache.plan(base_dp2[0], base_tp2[0], BUCKET_BYTES)
    fresh_plan, _ = gather_and_plan(base_dp2[0], base_tp2[0], BUCKET_BYTES)
    after_cached = [p.local.clone() for p in base_tp2[0]]
    flags.append(move(base_dp2, base_tp2, None, bucket_bytes=BUCKET_BYTES))
    uncached_equal = all(
        torch.equal(_bits(p.local), _bits(c)) for p, c in zip(base_tp2[0], after_cached)
    )
    PLAN_CACHE.clear()
    default = [reshard_weights(base_dp2[0], base_tp2[0]).plan_cached for _ in range(2)]
    out["repeat"] = (flags, cache.stats, cached_plan == fresh_plan, uncached_equal, default)

    def scenario(name: str, calls) -> None:
        cache = PlanCache()
        out[name] = ([move(s, d, cache, **kw) for s, d, kw in calls], cache.stats)

    bucket = {"bucket_bytes": BUCKET_BYTES}
    scenario(
        "layout_pair",
        [
            (base_dp2, base_tp2, bucket),
            (base_dp2, base_pp2, bucket),
            (base_tp2, base_dp2, bucket),
            (base_dp2, base_tp2, bucket),
        ],
    )
    scenario(
        "param_set",
        [
            (base_dp2, base_tp2, bucket),
            (get("no_bias", DP2), get("no_bias", TP2), bucket),
            (base_dp2, base_tp2, bucket),
        ],
    )
    renamed = ([dataclasses.replace(p, param_name="x." + p.param_name) for p in base_dp2[0]], None)
    scenario(
        "names",
        [(base_dp2, base_tp2, bucket), (renamed, base_tp2, bucket), (renamed, base_tp2, bucket)],
    )
    scenario(
        "shapes",
        [
            (base_dp2, base_tp2, bucket),
            (get("wider", DP2), get("wider", TP2), bucket),
            (base_dp2, base_tp2, bucket),
        ],
    )
    # float16 and bfloat16 have the same item size: only the dtype in the key tells them apart.
    scenario(
        "dtypes",
        [
            (get("bf16", DP2), get("bf16", TP2), bucket),
            (get("fp16", DP2), get("fp16", TP2), bucket),
            (get("bf16", DP2), get("bf16", TP2), bucket),
        ],
    )
    scenario(
        "bucket",
        [
            (base_dp2, base_tp2, bucket),
            (base_dp2, base_tp2, {"bucket_bytes": 2 * BUCKET_BYTES}),
            (base_dp2, base_tp2, bucket),
        ],
    )
    # The same pieces on the world and on a group of this rank alone (dp2 holds everything).
    rank = dist.get_rank()
    alone = [group_cache().get([r]) for r in range(dist.get_world_size())][rank]
    copy = get("base", DP2, "copy")
    scenario(
        "group",
        [
            (base_dp2, copy, bucket),
            (base_dp2, copy, {**bucket, "group": alone}),
            (base_dp2, copy, bucket),
            (base_dp2, copy, {**bucket, "group": alone}),
        ],
    )
    # Only rank 1's destination pieces change (their order): rank 0's own key still hits.
    pieces, want = base_tp2
    shuffled = (pieces[::-1], want[::-1]) if rank == 1 else base_tp2
    scenario(
        "one_rank",
        [(base_dp2, base_tp2, bucket), (base_dp2, shuffled, bucket), (base_dp2, shuffled, bucket)],
    )
    return out


@pytest.fixture(scope="module")
def record():
    return run_distributed(_scenarios, 2, timeout_s=300)


def _flags(record, name: str) -> list[bool]:
    """The scenario's cached flags, the same on both ranks."""
    first = record[0][name][0]
    assert all(r[name][0] == first for r in record), [r[name][0] for r in record]
    return first


def test_repeated_reshard_reuses_the_plan_bitwise(record):
    for flags, stats, same_plan, uncached_equal, default in (r["repeat"] for r in record):
        # Three cached-path calls, then the uncached path (cache=None) reports no cache.
        assert flags == [False, True, True, False]
        assert (stats.plans, stats.hits) == (1, 3)  # 3 reshards + the explicit plan() call
        assert same_plan, "the cached plan differs from a fresh plan of the same inputs"
        assert uncached_equal, "cached and uncached reshards differ"
        assert default == [False, True]  # reshard_weights' default cache


def test_layout_pair_change_replans(record):
    assert _flags(record, "layout_pair") == [False, False, False, True]


def test_parameter_set_change_replans(record):
    assert _flags(record, "param_set") == [False, False, True]


def test_parameter_name_change_replans(record):
    assert _flags(record, "names") == [False, False, True]


def test_shape_change_replans(record):
    assert _flags(record, "shapes") == [False, False, True]


def test_dtype_change_replans(record):
    assert _flags(record, "dtypes") == [False, False, True]


def test_bucket_change_replans(record):
    assert _flags(record, "bucket") == [False, False, True]


def test_process_group_change_replans(record):
    assert _flags(record, "group") == [False, False, True, True]


def test_one_rank_changing_alone_replans_everywhere(record):
    assert _flags(record, "one_rank") == [False, False, True]
    # Rank 0's own key hit: only the all-reduce told it that rank 1's inputs changed.
    assert record[0]["one_rank"][1].disagreements == 1
    assert record[1]["one_rank"][1].disagreements == 0
