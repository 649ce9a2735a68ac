"""Expert parallelism in ``ParallelLayout``: the string form (every dense form unchanged, ep and
etp appended), the expert rank groups equal megatron-core's expert ``RankGenerator``, and the rules
(ep x etp divides tp x cp x dp; experts by ep; expert FFN by etp; no ep on a dense model; MoE at
tp > 1 needs sequence parallelism; the all-gather dispatcher stays inside a tensor-parallel
group), each named with its values."""

from __future__ import annotations

import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import LayoutError, ParallelLayout, nearest_layout

DENSE = ModelConfig(num_layers=4, num_attention_heads=4, ffn_hidden_size=96)
MOE = ModelConfig(
    num_layers=4,
    num_attention_heads=4,
    ffn_hidden_size=96,
    num_experts=8,
    moe_ffn_hidden_size=48,
    sequence_parallel=True,
)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("tp2cp1pp1dp1", "tp2cp1pp1dp1"),
        ("tp2cp1pp2vpp2dp1", "tp2cp1pp2vpp2dp1"),
        ("tp=2,dp=2", "tp2cp1pp1dp2"),
        ("dp2ep1", "tp1cp1pp1dp2"),
        ("tp2ep2dp2", "tp2cp1pp1dp2ep2"),
        ("tp1ep2dp2", "tp1cp1pp1dp2ep2"),
        ("tp2dp2ep2etp1", "tp2cp1pp1dp2ep2etp1"),
        ("etp1tp2dp2ep2", "tp2cp1pp1dp2ep2etp1"),
        ("tp2dp2etp2", "tp2cp1pp1dp2"),  # etp equal to tp is megatron-core's default
        ("tp=1, dp=4, ep=4", "tp1cp1pp1dp4ep4"),
    ],
)
def test_string_form_round_trips(text, canonical):
    layout = ParallelLayout.parse(text)
    assert str(layout) == canonical
    assert ParallelLayout.parse(canonical) == layout
    assert hash(ParallelLayout.parse(canonical)) == hash(layout)


def test_ep_does_not_multiply_the_world_size():
    layout = ParallelLayout.parse("tp2ep2dp2")
    assert (layout.world_size, layout.expert_tp, layout.expert_dp) == (4, 2, 1)
    assert ParallelLayout.parse("tp2dp2ep2etp1").expert_dp == 2


SIZES = [
    (tp, cp, pp, dp, ep, etp)
    for tp, cp, pp, dp, ep, etp in itertools.product(
        [1, 2, 4], [1, 2], [1, 2], [1, 2, 4], [1, 2, 4, 8], [None, 1, 2]
    )
    if (tp * cp * dp) % (ep * (etp or tp)) == 0 and tp * cp * pp * dp <= 32
]
EXPERT_TOKENS = ["ep", "tp", "tp-ep", "tp-ep-pp", "dp", "pp"]
"""Every token megatron-core's initialize_model_parallel asks its expert RankGenerator for."""


@pytest.mark.parametrize(("tp", "cp", "pp", "dp", "ep", "etp"), SIZES, ids=str)
def test_expert_groups_equal_megatron_rank_generator(tp, cp, pp, dp, ep, etp):
    layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp)
    etp_size = etp or tp
    edp = tp * cp * dp // (ep * etp_size)
    gen = RankGenerator(tp=etp_size, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    ours = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    for token in EXPERT_TOKENS:
        axes = tuple(ours[a] for a in token.split("-"))
        assert layout.expert_groups(axes) == [tuple(g) for g in gen.get_ranks(token)], token
    # megatron-core asserts the expert and dense pipelines are the same rank sets
    assert layout.expert_groups("pp") == layout.groups("pp")


def _error(layout: ParallelLayout, world_size: int, model: ModelConfig) -> str:
    with pytest.raises(LayoutError) as info:
        layout.validate(world_size, model)
    return str(info.value)


@pytest.mark.parametrize(
    ("layout", "world", "model", "needles"),
    [
        (
            ParallelLayout(dp=2, ep=4),
            2,
            MOE,
            ["ep (4) x etp (1) = 4 does not divide tp (1) x cp (1) x dp (2) = 2"],
        ),
        (
            ParallelLayout(tp=2, dp=2, ep=2),
            4,
            ModelConfig(num_layers=4, num_attention_heads=4, num_experts=3, sequence_parallel=True),
            ["num_experts (3) % ep (2) != 0"],
        ),
        (
            ParallelLayout(tp=1, dp=4, ep=1, etp=4),
            4,
            ModelConfig(num_experts=4, moe_ffn_hidden_size=6),
            ["moe_ffn_hidden_size (6) % etp (4) != 0"],
        ),
        (ParallelLayout(dp=2, ep=2), 2, DENSE, ["ep (2) > 1 but the model is dense"]),
        (ParallelLayout(dp=2, etp=2), 2, DENSE, ["etp (2) set but the model is dense"]),
        (
            ParallelLayout(tp=2, ep=2, etp=1),
            2,
            ModelConfig(num_layers=4, num_attention_heads=4, num_experts=4),
            ["tp (2) > 1 with experts needs sequence_parallel: true"],
        ),
        (
            ParallelLayout(dp=2, ep=2),
            2,
            ModelConfig(num_experts=4, moe_token_dispatcher_type="allgather"),
            ["'allgather' gathers over the ep x etp (2 x 1) ranks", "use 'alltoall'"],
        ),
    ],
)
def test_expert_rules_name_their_values(layout, world, model, needles):
    message = _error(layout, world, model)
    for needle in needles:
        assert needle in message
    assert "nearest valid layout: " in message


def test_valid_expert_layouts():
    ParallelLayout(dp=2, ep=2).validate(2, MOE)
    ParallelLayout(tp=2, dp=2, ep=2, etp=1).validate(4, MOE)
    ParallelLayout(tp=2, dp=2, ep=2).validate(4, MOE)  # etp = tp = 2: ep x etp = 4 ranks
    ParallelLayout(cp=2, ep=2).validate(2, MOE)  # ep re-factors cp's ranks as megatron-core does
    # all-gather inside a tensor-parallel group: equal token counts (sequence-parallel shares)
    ParallelLayout(tp=2, ep=2, etp=1).validate(
        2, ModelConfig(num_experts=4, moe_token_dispatcher_type="allgather", sequence_parallel=True)
    )


def test_nearest_layout_drops_ep_for_a_dense_model_and_keeps_it_for_moe():
    assert nearest_layout(ParallelLayout(dp=2, ep=2), 2, DENSE) == ParallelLayout(dp=2)
    assert nearest_layout(ParallelLayout(dp=2, ep=2), 4, MOE) == ParallelLayout(dp=4, ep=2)
