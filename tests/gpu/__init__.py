"""The GPU tier: the same bodies as the CPU tests, on 1, 2 and 8 CUDA devices (NCCL), marked
``gpu`` and skipped without enough devices. Run with ``python -m pytest -q -m gpu tests/gpu`` or
``scripts/gpu_smoke.sh``. Nothing here has run on real hardware yet (README "On GPUs")."""

from __future__ import annotations

import os

import pytest
import torch


def requires_gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless this machine has at least ``count`` CUDA devices (one per rank)."""
    found = torch.cuda.device_count()
    return pytest.mark.skipif(
        found < count, reason=f"needs {count} CUDA device(s), this machine has {found}"
    )


def visible_gpus() -> list[str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` entries, in the order CUDA numbers them
    (``cuda:i`` is entry i): the ones it lists when set, else every device. For child processes
    that must compute on a given GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def to_host(tree):
    """``tree`` with every tensor copied to the host, so per-rank results unpickle anywhere."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_host(v) for v in tree)
    return tree
