"""Megatron-Core's fusion decorator compiles a function when it is first called, not when it is
defined.

What: ``megatron.core.jit.jit_fuser`` becomes ``lazy_compile``: ``torch.compile(fn)`` made on the
  first call of ``fn`` (with the same arguments as megatron-core's decorator), not when the
  decorator runs. ``install_import_hook()`` (called by ``megatron_earl/__init__.py``, before
  megatron-core is imported) replaces the attribute right after ``megatron.core.jit`` has run,
  before any fusion module takes it; ``apply()`` only checks the target.
Why: megatron-core decorates ~38 fusion functions at import (``fusions/fused_bias_geglu`` and
  siblings, ``jit_fuser = torch.compile`` for torch >= 2.2), and ``torch.compile(fn)`` imports
  ``torch._dynamo`` and inductor even when ``fn`` never runs: ~1.3 s of CPU time in every
  process that imports megatron-core (each rank of a run, every ``megatron-earl serve``). This
  project turns every fusion off (``config.model.transformer_config``), so none of them runs;
  if one did, it would be compiled at its first call exactly as before.
Versions: megatron-core>=0.16.0,<0.17.0 (``jit_fuser`` as in 0.16.1's ``megatron/core/jit.py``).
Test: tests/unit/test_patches.py (test_megatron_core_import_leaves_dynamo_unloaded,
  test_lazy_compile_compiles_at_the_first_call)
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

from megatron_earl.patches import Target, check_targets

VERSIONS = ">=0.16.0,<0.17.0"
TARGETS = (Target("megatron.core.jit", "jit_fuser"),)
MODULE = "megatron.core.jit"


def lazy_compile(fn: Callable | None = None, **kwargs: Any) -> Callable:
    """``torch.compile(fn, **kwargs)``, made at the first call of the returned function (also as
    ``@lazy_compile(**kwargs)``). Local."""
    if fn is None:
        return functools.partial(lazy_compile, **kwargs)
    compiled: Callable | None = None

    @functools.wraps(fn)
    def call(*args: Any, **call_kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **kwargs)
        return compiled(*args, **call_kwargs)

    return call


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` with the other finders and swaps its ``jit_fuser`` for
    ``lazy_compile`` once the module has run (only when it is ``torch.compile``: a later
    megatron-core that chose differently is left alone)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # one module, imported once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            if module.jit_fuser is sys.modules["torch"].compile:
                module.jit_fuser = lazy_compile

        spec.loader.exec_module = exec_then_patch
        return spec


def install_import_hook() -> None:
    """Make the next import of ``megatron.core.jit`` use ``lazy_compile`` (no effect once it is
    imported). Idempotent. Local."""
    if MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def apply() -> bool:
    """Check the target; True when ``jit_fuser`` is ``lazy_compile`` (megatron-core was imported
    after ``install_import_hook``). Local."""
    check_targets(__name__, VERSIONS, TARGETS)
    return TARGETS[0].get() is lazy_compile
