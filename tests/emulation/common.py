"""Shared pieces of the emulation tier: the environment that turns it on, and host copies of
results (a device tensor cannot leave its process, as on CUDA)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

EMULATED = {"MEGATRON_EARL_EMULATE_DEVICE": "1"}


def to_host(value: Any) -> Any:
    """``value`` with every tensor copied to the host (run in the rank, before returning)."""
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, value)


def on_emulated_device(tensors) -> bool:
    """Whether every tensor lives on this rank's emulated device (``emu:LOCAL_RANK``)."""
    from megatron_earl import runtime

    return all(t.device == runtime.device() for t in tensors)
