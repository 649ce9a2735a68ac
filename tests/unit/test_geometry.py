"""Region arithmetic and piece views of ``redistribute.geometry`` (pure, no processes).

``shard_pieces`` itself runs on real Megatron models in tests/distributed (test_reshard.py,
test_model_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_earl.redistribute.geometry import (
    ShardPiece,
    intersect,
    region_numel,
    region_shape,
    region_slices,
    relative,
)


@pytest.mark.parametrize(
    "a,b,want",
    [
        (((0, 4), (0, 8)), ((2, 6), (4, 12)), ((2, 4), (4, 8))),
        (((0, 4),), ((4, 8),), None),  # touching is not overlapping
        (((0, 4), (0, 8)), ((1, 2), (3, 5)), ((1, 2), (3, 5))),  # containment
        (((0, 1), (0, 8)), ((1, 2), (0, 8)), None),  # different layers
        ((), (), ()),  # scalars
    ],
)
def test_intersect(a, b, want):
    assert intersect(a, b) == want
    assert intersect(b, a) == want


def test_intersect_rejects_different_ranks():
    with pytest.raises(ValueError, match="different rank"):
        intersect(((0, 1),), ((0, 1), (0, 1)))


def test_relative_and_shapes():
    origin = ((2, 6), (4, 12))
    assert relative(((3, 5), (4, 8)), origin) == ((1, 3), (0, 4))
    assert region_shape(origin) == (4, 8)
    assert region_numel(origin) == 32
    assert region_slices(origin) == (slice(2, 6), slice(4, 12))
    with pytest.raises(ValueError, match="not inside"):
        relative(((1, 5), (4, 8)), origin)


def test_region_view_restores_prepended_layer_axis():
    param = torch.arange(24.0).reshape(6, 4)
    # A TP-split gated fc1: the "up" half of this rank is rows 3..6 of the local parameter, and
    # the global tensor is layer-stacked (layer 1 of 2).
    local = param[3:6]
    piece = ShardPiece(
        key="decoder.layers.mlp.linear_fc1.weight",
        global_shape=(2, 12, 4),
        region=((1, 2), (9, 12), (0, 4)),
        local=local,
        param_name="chunk0.decoder.layers.0.mlp.linear_fc1.weight",
        param=param,
        is_replica=False,
    )
    view = piece.region_view()
    assert view.shape == (1, 3, 4)
    assert view.data_ptr() == local.data_ptr()
    view[0, 0, 0] = -1.0
    assert param[3, 0] == -1.0  # a view, not a copy
    grad = torch.zeros_like(param)
    piece.view_of(grad).fill_(1.0)
    assert grad[3:6].eq(1).all() and grad[:3].eq(0).all()
