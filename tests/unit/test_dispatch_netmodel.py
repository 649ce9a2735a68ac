"""Network model (pure): hand-computed stage times, and the projection at 128 GPUs (16 nodes)
shows at least EARL's 11.2x lower dispatch time than the centralized baseline."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.dispatch.batch import FieldSpec
from megatron_earl.dispatch.bench import _args, project
from megatron_earl.dispatch.netmodel import NetworkModel
from megatron_earl.dispatch.route import DispatchError, Piece, Transfer

SCHEMA = (FieldSpec("x", torch.float32, True),)


def test_stage_time_by_hand():
    model = NetworkModel(gpus_per_node=2, nvlink_gbps=1.0, nic_gbps=0.5, latency_us=1.0)
    piece = Piece(0, 0, 250_000_000, ("x",))  # 1 GB
    intra = [Transfer(0, 1, piece)]
    inter = [Transfer(0, 2, piece), Transfer(1, 3, piece)]  # both leave node 0: 2 GB on its NIC
    assert model.seconds([intra], SCHEMA) == pytest.approx(1.0 + 1e-6)
    assert model.seconds([inter], SCHEMA) == pytest.approx(4.0 + 1e-6)
    assert model.seconds([intra, inter, [Transfer(3, 3, piece)]], SCHEMA) == pytest.approx(5 + 2e-6)
    with pytest.raises(DispatchError, match="must be > 0"):
        NetworkModel(nic_gbps=0)


def test_projection_at_128_gpus_reaches_earl_ratio():
    (row,) = project(_args(["--proj-gpus", "128"]), NetworkModel())
    assert row["layout"] == "tp4cp2pp2dp8"
    assert row["ratio"] >= 11.2, row
    assert row["busiest_bytes_centralized"] > 10 * row["busiest_bytes_decentralized"]
