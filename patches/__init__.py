"""Every change megatron-earl makes to Megatron-Core's behaviour, one module per patch.

    from megatron_earl import patches
    patches.apply_all()        # runtime.initialize() does this once per process

This directory is the top-level ``patches/`` of the repository; it installs as the
``megatron_earl.patches`` package (``package_dir`` in setup.py; a source checkout or an editable
install loads it from here, see ``megatron_earl/__init__.py``). Nothing outside it assigns to a
Megatron-Core attribute (``tests/unit/test_patches.py`` scans the package).

Each patch module opens with a header (What / Why / Versions / Test), declares ``VERSIONS`` (the
megatron-core releases it is written for; equal to the version guard
``megatron_earl.compat.version.SUPPORTED_MCORE``) and ``TARGETS`` (every Megatron-Core attribute it
reads or replaces), and has an ``apply()``. ``apply()`` first resolves every target, so a target
that the installed Megatron-Core no longer has fails at start-up with ``PatchTargetError`` naming
the patch and the version, never mid-run. Two kinds of patch:

* applied once: ``apply()`` installs it for the life of the process (idempotent);
* scoped: the module offers a context manager that a call site enters around the one Megatron call
  that needs it; ``apply()`` only checks its targets.

Source patches (``.patch`` files against Megatron-Core's source) would also live here; there are
none.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

PATCHES: tuple[str, ...] = (
    "quiet_warnings",
    "lazy_jit_fuser",
    "cpu_rng_tracker",
    "cpu_redirect",
    "parallel_state_groups",
    "checkpoint_results_queue",
    "checkpoint_writers_die_with_rank",
    "output_layer_passthrough",
    "rope_tables",
    "moe_router_without_te",
    "moe_host_splits",
)
"""Every patch module, in the order ``apply_all`` applies them."""


class PatchTargetError(RuntimeError):
    """A patch's target does not exist in the installed Megatron-Core."""


@dataclass(frozen=True)
class Target:
    """One Megatron-Core attribute a patch reads or replaces: ``module`` and a dotted ``path``
    inside it (``"Class.method"``)."""

    module: str
    path: str

    def __str__(self) -> str:
        return f"{self.module}.{self.path}"

    def owner(self) -> tuple[Any, str]:
        """The object holding the attribute, and the attribute's name."""
        owner: Any = importlib.import_module(self.module)
        *parents, attr = self.path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, attr

    def get(self) -> Any:
        """The attribute's value; for a class attribute the raw ``__dict__`` entry (unbound)."""
        owner, attr = self.owner()
        return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

    def set(self, value: Any) -> None:
        owner, attr = self.owner()
        setattr(owner, attr, value)

    def exists(self) -> bool:
        try:
            owner, attr = self.owner()
        except (ImportError, AttributeError):
            return False
        return attr in owner.__dict__ if isinstance(owner, type) else hasattr(owner, attr)


def installed_megatron_core() -> str:
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def check_targets(patch: str, versions: str, targets: Iterable[Target]) -> None:
    """Raise ``PatchTargetError`` naming ``patch``, the missing targets and the installed
    megatron-core version unless every target exists. Local."""
    missing = [str(t) for t in targets if not t.exists()]
    if missing:
        raise PatchTargetError(
            f"patch {patch!r} cannot apply: megatron-core {installed_megatron_core()} has no "
            f"{', '.join(missing)} (the patch is written for megatron-core{versions}; see "
            f"patches/{patch.rsplit('.', 1)[-1]}.py)"
        )


def apply_all() -> list[str]:
    """Apply every patch in ``PATCHES`` order; return the names of those installed for the life
    of the process (CPU-only patches are skipped on a CUDA machine). Idempotent. Local."""
    applied = []
    for name in PATCHES:
        module = importlib.import_module(f"{__name__}.{name}")
        if module.apply():
            applied.append(name)
    return applied
