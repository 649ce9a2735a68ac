"""``ParallelLayout``: rank math equals megatron-core's ``RankGenerator`` over a table of sizes;
bad layouts raise one error naming every value and the nearest valid layout."""

from __future__ import annotations

import itertools

import pytest
from megatron.core.parallel_state import (
    RankGenerator,
    default_embedding_ranks,
    default_position_embedding_ranks,
)

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import Coord, LayoutError, ParallelLayout, nearest_layout

# Every token Megatron's initialize_model_parallel asks its decoder RankGenerator for, plus the
# remaining axis combinations.
TOKENS = [
    "tp",
    "cp",
    "dp",
    "pp",
    "tp-pp",
    "tp-cp",
    "dp-cp",
    "tp-dp",
    "tp-dp-cp",
    "tp-cp-pp",
    "tp-dp-pp",
    "cp-dp-pp",
    "tp-cp-dp-pp",
]
SIZES = [
    (tp, cp, pp, dp)
    for tp, cp, pp, dp in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 4], [1, 2, 3])
    if tp * cp * pp * dp <= 48
]
MODEL = ModelConfig(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=200,
    make_vocab_size_divisible_by=16,
)


@pytest.mark.parametrize(("tp", "cp", "pp", "dp"), SIZES, ids=lambda v: str(v))
def test_groups_equal_megatron_rank_generator(tp, cp, pp, dp):
    layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for token in TOKENS:
        expected = [tuple(g) for g in gen.get_ranks(token)]
        assert layout.groups(tuple(token.split("-"))) == expected, token
    pp_groups = gen.get_ranks("pp")
    assert layout.embedding_groups() == [tuple(default_embedding_ranks(g)) for g in pp_groups]
    assert layout.position_embedding_groups() == [
        tuple(default_position_embedding_ranks(g)) for g in pp_groups
    ]


@pytest.mark.parametrize(("tp", "cp", "pp", "dp"), SIZES[::7], ids=lambda v: str(v))
def test_coord_rank_round_trip_and_megatron_rank_formula(tp, cp, pp, dp):
    layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp)
    for rank in range(layout.world_size):
        c = layout.coord(rank)
        assert layout.rank(c) == rank
        assert rank == c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
        assert rank in layout.group_of(rank, "tp")
    with pytest.raises(LayoutError, match="outside layout"):
        layout.coord(layout.world_size)


def test_coord_type_and_str_parse_round_trip():
    layout = ParallelLayout(tp=2, cp=1, pp=2, dp=3, vpp=2)
    assert ParallelLayout.parse(str(layout)) == layout
    assert ParallelLayout.parse("tp=2, dp=2") == ParallelLayout(tp=2, dp=2)
    assert layout.coord(5) == Coord(tp=1, cp=0, dp=2, pp=0)
    with pytest.raises(LayoutError, match="cannot parse"):
        ParallelLayout.parse("tp2 zz3")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tp": 0}, "'tp': 0"),
        ({"dp": 1.5}, "'dp': 1.5"),
        ({"ep": 0}, "'ep': 0"),
        ({"etp": 0}, "'etp': 0"),
        ({"pp": 1, "vpp": 2}, "vpp=2 with pp=1"),
    ],
)
def test_constructor_rejects_bad_sizes(kwargs, needle):
    with pytest.raises(LayoutError, match=needle):
        ParallelLayout(**kwargs)


def _error(layout: ParallelLayout, **kwargs) -> str:
    with pytest.raises(LayoutError) as info:
        layout.validate(**kwargs)
    return str(info.value)


def test_product_not_world_size_names_every_value_and_nearest():
    msg = _error(ParallelLayout(tp=2, pp=2), world_size=2)
    assert "tp(2) * cp(1) * pp(2) * dp(1) = 4 != world size (2)" in msg
    assert msg.endswith("nearest valid layout: tp2cp1pp1dp1")
    # Keeps tp, cp, pp and fixes dp when the world allows it.
    assert nearest_layout(ParallelLayout(tp=2, cp=2), 8) == ParallelLayout(tp=2, cp=2, dp=2)


def test_tp_not_dividing_query_groups():
    msg = _error(ParallelLayout(tp=4), world_size=4, model=MODEL)
    assert "num_query_groups (2) % tp (4) != 0" in msg
    assert "nearest valid layout: tp2cp1pp1dp2" in msg


def test_pp_larger_than_layer_count():
    msg = _error(ParallelLayout(pp=8), world_size=8, model=MODEL)
    assert "pp (8) > num_layers (4)" in msg
    assert "nearest valid layout: tp1cp1pp4dp2" in msg


def test_cp_sequence_not_divisible_without_padding():
    layout = ParallelLayout(cp=2)
    msg = _error(layout, world_size=2, seq_length=1001)
    assert "seq_length (1001) is not divisible by 2 x cp (4, cp=2)" in msg
    assert "pad sequences to 1004" in msg
    assert "nearest valid layout: tp1cp1pp1dp2" in msg
    layout.validate(2, seq_length=1001, pad_sequences=True)
    layout.validate(2, seq_length=1000)


def test_one_error_names_every_problem():
    msg = _error(ParallelLayout(tp=4, cp=2, pp=8), world_size=8, model=MODEL, seq_length=10)
    for needle in (
        "tp(4) * cp(2) * pp(8) * dp(1) = 64 != world size (8)",
        "pp (8) > num_layers (4)",
        "num_query_groups (2) % tp (4)",
        "num_layers (4) % (pp (8)",
        "seq_length (10) is not divisible by 2 x cp (4, cp=2)",
        "nearest valid layout: ",
    ):
        assert needle in msg
    assert msg.count("nearest valid layout") == 1


def test_vpp_kept_or_dropped_by_distance():
    ParallelLayout(pp=2, vpp=2).validate(2, MODEL)
    # 4 layers cannot fill pp4 x vpp2: dropping vpp (distance 1) beats pp2 vpp2 dp2 (distance 2).
    near = nearest_layout(ParallelLayout(pp=4, vpp=2), 4, ModelConfig(num_layers=4))
    assert near == ParallelLayout(pp=4)
    near = nearest_layout(ParallelLayout(pp=4, vpp=2), 4, ModelConfig(num_layers=16))
    assert near == ParallelLayout(pp=4, vpp=2)
    near = nearest_layout(ParallelLayout(pp=4, vpp=2, dp=2), 4, ModelConfig(num_layers=8))
    assert near == ParallelLayout(pp=4, vpp=2)
    near = nearest_layout(ParallelLayout(pp=2, vpp=2), 2, ModelConfig(num_layers=2))
    assert near == ParallelLayout(pp=2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8, 12])
@pytest.mark.parametrize(
    "layout", [ParallelLayout(tp=4), ParallelLayout(cp=2, pp=2), ParallelLayout(tp=3, dp=5)]
)
def test_nearest_layout_is_always_valid(world_size, layout):
    near = nearest_layout(layout, world_size, MODEL, seq_length=64)
    assert near is not None
    assert near.problems(world_size, MODEL, seq_length=64) == []


def test_valid_layout_passes_and_check_helpers():
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    layout.validate(8, MODEL, seq_length=7)
    layout.check_world(8)
    layout.check_model(MODEL)
    with pytest.raises(LayoutError, match="world size"):
        layout.check_world(4)
    with pytest.raises(LayoutError, match="num_query_groups"):
        ParallelLayout(tp=4).check_model(MODEL)
