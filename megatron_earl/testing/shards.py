"""Test helper: reassemble global tensors from the shard regions several ranks report."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_earl.redistribute.geometry import Region, region_slices

RegionPiece = tuple[str, tuple[int, ...], Region, torch.Tensor]
"""(global key, global shape, region [start, stop) per dim, the region's values)."""


def assemble_regions(piece_lists: Iterable[Iterable[RegionPiece]]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's pieces; asserts that every element is covered."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for pieces in piece_lists:
        for key, shape, region, values in pieces:
            full = out.setdefault(key, torch.zeros(shape))
            cov = covered.setdefault(key, torch.zeros(shape, dtype=torch.bool))
            sl = region_slices(region)
            full[sl] = values.reshape(full[sl].shape)
            cov[sl] = True
    for key, cov in covered.items():
        assert cov.all(), f"{key}: not fully covered by the ranks' shards"
    return out
