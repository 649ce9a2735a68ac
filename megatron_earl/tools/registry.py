"""Name -> class registries for pluggable components (environments, tools, reward functions),
with specs loadable from YAML or given as dotted paths.

A spec is one of:
  * a registered name: ``"calculator"``;
  * a dotted path to a class or factory: ``"my_pkg.envs:MyEnv"`` or ``"my_pkg.envs.MyEnv"``;
  * a mapping ``{"name": <name or dotted path>, "kwargs": {...}}`` (``args`` is accepted for
    ``kwargs``), e.g. a YAML block;
  * a path to a ``.yaml``/``.yml`` file holding such a mapping.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

T = TypeVar("T")


def import_dotted(path: str) -> Any:
    """Import ``"pkg.mod:attr"`` or ``"pkg.mod.attr"``; raises ``ImportError`` naming ``path``."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not a dotted path like 'pkg.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} of {path!r}: {e}") from e
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from e
    return obj


def normalize_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name_or_dotted_path, kwargs)`` of a spec (see the module docstring)."""
    if isinstance(spec, str) and spec.endswith((".yaml", ".yml")):
        spec = yaml.safe_load(Path(spec).read_text())
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ValueError(f"spec must be a name, a dotted path or {{name, kwargs}}, got {spec!r}")
    unknown = set(spec) - {"name", "kwargs", "args"}
    if unknown:
        raise ValueError(f"spec {spec!r} has unknown keys {sorted(unknown)}; valid: name, kwargs")
    kwargs = dict(spec.get("kwargs") or spec.get("args") or {})
    return spec["name"], kwargs


class Registry(Generic[T]):
    """Registered factories of one kind (``kind`` appears in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Class/function decorator registering a factory under ``name``."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories and self._factories[name] is not factory:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return deco

    def names(self) -> list[str]:
        return sorted(self._factories)

    def resolve(self, name: str) -> Callable[..., T]:
        """The factory of a registered name or a dotted path."""
        if name in self._factories:
            return self._factories[name]
        if "." in name or ":" in name:
            return import_dotted(name)
        raise KeyError(
            f"unknown {self.kind} {name!r}; registered: {self.names()} "
            "(or give a dotted path 'pkg.module:Name')"
        )

    def build(self, spec: str | Mapping[str, Any], **overrides: Any) -> T:
        """Instantiate a spec; ``overrides`` update the spec's kwargs."""
        name, kwargs = normalize_spec(spec)
        return self.resolve(name)(**{**kwargs, **overrides})

    def factory(self, spec: str | Mapping[str, Any], **overrides: Any) -> Callable[[], T]:
        """A zero-argument factory for a spec (resolved now, so errors surface early)."""
        name, kwargs = normalize_spec(spec)
        fn = self.resolve(name)
        kwargs.update(overrides)
        return lambda: fn(**kwargs)
