"""Detection of optional packages: used when present, never required.

NVIDIA Apex is not detected here: Megatron-Core itself uses its fused Adam and multi-tensor kernels
when ``apex`` is importable (and falls back to torch's otherwise); it is built from source, see
README "On GPUs". (PyPI's ``apex`` is an unrelated package.)"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def has_package(name: str) -> bool:
    """True when ``name`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def has_transformer_engine() -> bool:
    return has_package("transformer_engine")


def has_sglang() -> bool:
    return has_package("sglang")
