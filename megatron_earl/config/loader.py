"""YAML files + dotted overrides -> typed ``RunConfig`` (and back), with strict checking.

    cfg = load_config("configs/demo_cpu.yaml", ["train.lr=1e-4", "rollout.max_turns=4"])
    save_config(cfg, cfg.run_dir / "config.yaml")      # the fully resolved config
    assert load_config(cfg.run_dir / "config.yaml") == cfg

The YAML is read with omegaconf (``${...}`` interpolations resolve), overrides are omegaconf
dotlists (``key=value``, values typed as YAML: ``1e-4``, ``true``, ``null``, ``[a,b]``) merged on
top. The merged tree is then mapped onto the dataclasses by ``config_from_tree``, which checks every
key and value against the dataclass annotations and raises ONE ``ConfigError`` listing all
problems: unknown keys (with the nearest valid key, by difflib), wrong types (key, value and
expected type), and each section's own ``__post_init__`` validation. ints are accepted where a
float is expected, and a name where a vocabulary (``config.vocab``: phase, engine kind) is
expected (the section turns it into the member, or names the valid ones); nothing else is
converted. Missing keys take the dataclass defaults. Vocabulary members are written back as their
plain strings.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from megatron_earl.config.run import ConfigError, RunConfig

T = typing.TypeVar("T")


def load_config(
    path: str | Path | None = None, overrides: Iterable[str] = (), *, cls: type[T] = RunConfig
) -> T:
    """The typed config of a YAML file (None: all defaults) with dotted ``overrides`` applied."""
    return config_from_tree(merged_tree(path, overrides), cls)


def merged_tree(path: str | Path | None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The YAML file's mapping with the overrides merged in, interpolations resolved."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.create({})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            base = OmegaConf.load(path)
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            raise ConfigError(f"cannot parse config file {str(path)!r}: {err}") from None
        if not OmegaConf.is_dict(base):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    merged = OmegaConf.merge(base, parse_overrides(overrides))
    try:
        tree = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve config interpolation: {err}") from None
    return typing.cast(dict[str, Any], tree)


def parse_overrides(overrides: Iterable[str]):
    """An omegaconf ``DictConfig`` of ``key=value`` items; raises ``ConfigError`` on a bad item."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    items = list(overrides)
    bad = [item for item in items if "=" not in item or not item.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError(f"overrides {bad} are not key=value (e.g. train.lr=1e-4)")
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot parse overrides {items}: {err}") from None


def config_from_tree(tree: Mapping[str, Any], cls: type[T] = RunConfig) -> T:
    """Build ``cls`` from a plain nested mapping; raises one ``ConfigError`` with every problem."""
    problems: list[str] = []
    value = _build(cls, tree, "", problems, _all_paths(cls))
    if problems:
        raise ConfigError(
            f"invalid configuration ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
            + "\n  ".join(problems)
        )
    return typing.cast(T, value)


def config_to_tree(config: Any) -> dict[str, Any]:
    """A plain nested dict of a config dataclass (tuples as lists), ready for YAML."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, enum.Enum):
            return value.value
        return value

    return plain(config)


def dump_config(config: Any) -> str:
    """The YAML text of a config dataclass (loads back to an equal config)."""
    return yaml.safe_dump(config_to_tree(config), sort_keys=False, default_flow_style=False)


def save_config(config: Any, path: str | Path) -> Path:
    """Write the fully resolved config as YAML (atomically: temp file + rename); returns the path.
    Call on one rank (rank 0)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("# fully resolved megatron-earl config\n" + dump_config(config))
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------- mapping


def _build(cls: type, tree: Any, path: str, problems: list[str], all_paths: list[str]) -> Any:
    """One dataclass from a mapping; appends problems instead of raising."""
    if not isinstance(tree, Mapping):
        problems.append(f"{path or '<top level>'}: expected a mapping (section), got {tree!r}")
        return None
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    ok = True
    for key, value in tree.items():
        full = f"{path}{key}"
        if key not in names:
            problems.append(_unknown_key(str(key), path, names, all_paths))
            ok = False
            continue
        before = len(problems)
        kwargs[key] = _coerce(value, hints[key], full, problems, all_paths)
        ok = ok and len(problems) == before
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except ValueError as err:  # the section's __post_init__ (ConfigError is a ValueError)
        message = str(err)
        section = path.rstrip(".")
        prefix = f"{section.rsplit('.', 1)[-1]}: "
        if section and message.startswith(prefix):
            message = message[len(prefix) :]
        problems.append(f"{section}: {message}" if section else message)
        return None


def _coerce(value: Any, tp: Any, path: str, problems: list[str], all_paths: list[str]) -> Any:
    """``value`` checked against the annotation ``tp`` (a problem is appended when it fails)."""
    ok, result = _try(value, tp, path, problems, all_paths)
    if not ok:
        problems.append(
            f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})"
        )
    return result


def _try(value: Any, tp: Any, path: str, problems: list[str], all_paths: list[str]):
    """(ok, converted). Section errors inside nested dataclasses go to ``problems`` directly."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return type(None) in args, None
        for option in args:
            if option is not type(None):
                ok, result = _try(value, option, path, [], all_paths)
                if ok:
                    return True, result
        return False, None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            return False, None
        return True, _build(tp, value, f"{path}.", problems, all_paths)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return False, None
        item_type = args[0] if args else Any
        items = [_try(v, item_type, path, problems, all_paths) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if origin is dict or tp is dict:
        return isinstance(value, Mapping), dict(value) if isinstance(value, Mapping) else None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and not math.isfinite(value):  # NaN/inf would pass every range check after it
            problems.append(f"{path}: must be a finite number, got {value!r}")
            return True, float(value)
        return ok, float(value) if ok else None
    if tp is str or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        return isinstance(value, str), value  # a vocabulary name is checked by its section
    raise TypeError(f"{path}: unsupported config annotation {tp!r}")  # a bug in a config class


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is tuple:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {', '.join(m.value for m in tp)}"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _all_paths(cls: type, prefix: str = "") -> list[str]:
    """Every valid dotted key of ``cls`` (sections and leaves)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(_all_paths(hints[f.name], f"{prefix}{f.name}."))
    return out


def _unknown_key(key: str, path: str, siblings: list[str], all_paths: list[str]) -> str:
    """The message for an unknown key, with the nearest valid key."""
    full = f"{path}{key}"
    guess = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if guess:
        near = path + guess[0]
    else:
        same_leaf = [p for p in all_paths if p.rsplit(".", 1)[-1] == key]
        near_paths = same_leaf or difflib.get_close_matches(full, all_paths, n=1, cutoff=0.6)
        near = near_paths[0] if near_paths else None
    hint = f"did you mean '{near}'?" if near else f"valid keys here: {', '.join(siblings)}"
    return f"unknown key '{full}'; {hint}"
