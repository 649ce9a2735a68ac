"""``shard_pieces`` on fake modules (pure, one process): persistent buffers in the checkpoint
geometry become pieces (the router's ``expert_bias`` is one), non-persistent buffers do not, and a
parameter that the geometry leaves out, or covers only in part, raises naming it (it could not
be resharded). Real Megatron models: tests/distributed/test_reshard*.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_earl.redistribute.geometry import shard_pieces


class _Fake(nn.Module):
    """A weight [4, 6] stored as the rows ``rows`` of a global [8, 6] tensor (index 1 of 2), a
    persistent ``bias`` buffer and a non-persistent counter; ``sharded_state_dict`` describes
    ``described`` of them (the weight optionally only in part)."""

    def __init__(self, described: tuple[str, ...], weight_rows: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(24.0).reshape(4, 6))
        self.register_buffer("bias", torch.ones(3))
        self.register_buffer("count", torch.zeros(3), persistent=False)
        self.described, self.weight_rows = described, weight_rows

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        out = {}
        if "weight" in self.described:
            data = self.weight if self.weight_rows == 4 else self.weight[: self.weight_rows]
            out["w"] = ShardedTensor.from_rank_offsets("w", data, (0, 1, 2))
        for name in ("bias", "count"):
            if name in self.described:
                out[name] = ShardedTensor.from_rank_offsets(name, getattr(self, name))
        return out


def test_persistent_buffers_are_pieces():
    pieces = shard_pieces([_Fake(("weight", "bias"))])
    assert [(p.key, p.region, p.param_name) for p in pieces] == [
        ("w", ((4, 8), (0, 6)), "chunk0.weight"),
        ("bias", ((0, 3),), "chunk0.bias"),
    ]
    assert pieces[1].local.data_ptr() == pieces[1].param.data_ptr()  # a view: writes land


def test_a_parameter_left_out_of_the_geometry_raises():
    with pytest.raises(ValueError, match=r"chunk 0: parameters not covered.*'weight': \(0, 24\)"):
        shard_pieces([_Fake(("bias",))])


def test_a_parameter_covered_in_part_raises():
    # the geometry describes a view of 2 of its 4 rows, not the parameter: nothing covers it
    module = _Fake(("weight",), weight_rows=2)
    with pytest.raises(ValueError, match="parameters not covered"):
        shard_pieces([module])
