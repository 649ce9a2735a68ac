"""Stands in for the op schemas of torchvision's C++ extension when that extension cannot load.

Installed into the SGLang venv by ``scripts/install_sglang_cpu.sh`` together with
``earl_torchvision_schemas.pth``, whose one line imports this module at interpreter start-up;
nothing in megatron-earl imports it. Why: the registry's torchvision 0.28.0 is a CUDA build, and
next to the CPU torch 2.13.0 its ``_C`` extension does not load. torchvision then still imports
its Python parts, except that ``torchvision/_meta_registrations.py`` registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms``, which dies on ``operator torchvision::nms does
not exist``; SGLang imports ``torchvision.transforms`` unconditionally. Defining the two schemas
(no kernel: calling them still fails) lets the import through.

Importing this module is cheap: it only puts a finder on ``sys.meta_path`` (torch is not
imported at start-up). The finder acts once, when ``torchvision._meta_registrations`` is about to
be imported, and only when ``torchvision.extension`` reports that the C++ ops did not load, so a
torchvision whose extension works (which then defines these ops itself) is left alone.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

TRIGGER = "torchvision._meta_registrations"
"""The torchvision module that needs the ops to exist (it is imported right after the extension
has or has not loaded, in ``torchvision/__init__.py``)."""

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)

_library: Any = None
"""The ``torch.library.Library`` holding the definitions: they last as long as it is alive."""


def define_missing_schemas() -> None:
    """Define ``SCHEMAS`` in the ``torchvision`` op namespace unless torchvision's C++ extension
    loaded (then it registered them itself)."""
    global _library
    extension = sys.modules.get("torchvision.extension")
    if extension is not None and extension._has_ops():
        return
    import torch

    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        _library.define(schema)


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == TRIGGER:
            sys.meta_path.remove(self)
            define_missing_schemas()
        return None  # the regular finders import the module


sys.meta_path.insert(0, _BeforeMetaRegistrations())
