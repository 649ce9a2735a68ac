"""Save and restore the parallelism selector's state, so a resumed run continues its decisions.

    state = selector_state(selection.selectors, points)      # JSON-able dict, every rank alike
    path.write_text(json.dumps(state))                      # e.g. next to the model checkpoint
    points = load_selector_state(selection.selectors, json.loads(path.read_text()))

Saved (version 1), for ``selectors`` = one ``Selector`` per selected phase, keyed by phase:

* per selector: ``current`` (phase -> layout), ``infeasible`` (sorted ``[phase, layout, bucket]``
  rows: the OOM marks) and ``history`` (phase -> the last ``trend_window`` longest lengths, all the
  length trend reads);
* once, since the selectors share them: the ``ThroughputTable``'s ``cells`` and ``counts`` as
  ``[phase, layout, bucket, value]`` rows in the table's own order (the roofline scale sums over
  the cells in that order, so a restored table predicts bit-for-bit the same), and every field of
  the shared ``MemoryModel``'s ``MemorySettings`` whose value is JSON-able (the calibrated
  constants included; a field that is not keeps the resuming run's value);
* the calibration points (``dataclasses.asdict``, tuples as lists).

Not saved: the decision ``log`` (already in the metrics), the configs, the candidates and the
roofline (the resuming run builds them from its own config; the loader checks that every saved
layout is one of its candidates; a selected phase the state lacks keeps its fresh state). Loading
validates the whole state first and then applies it, so a state that does not fit the run raises
``ValueError`` and restores nothing. Pure: no collectives, no files; every rank may save (all hold
the same state) and every rank loads.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from typing import Any

from megatron_earl.config.vocab import PHASES
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.selector.calibrate import CalibrationPoint
from megatron_earl.selector.decide import Selector
from megatron_earl.selector.memory import MemoryModel, MemorySettings
from megatron_earl.selector.throughput import ThroughputTable

VERSION = 1
_SKIP = object()  # a value with no JSON form


def selector_state(
    selectors: dict[str, Selector], points: Sequence[CalibrationPoint] = ()
) -> dict[str, Any]:
    """The selectors' state as a JSON-able dict (only str/int/float/bool/None/list/dict)."""
    table, memory = _shared(selectors)
    settings = {}
    for f in dataclasses.fields(MemorySettings):
        value = _to_json(getattr(memory.settings, f.name))
        if value is not _SKIP:
            settings[f.name] = value
    state = {
        "version": VERSION,
        "selectors": {
            name: {
                "current": {phase: str(layout) for phase, layout in sel.current.items()},
                "infeasible": [list(mark) for mark in sorted(sel.infeasible)],
                "history": {
                    phase: list(lengths[-sel.config.trend_window :])
                    for phase, lengths in sel.history.items()
                },
            }
            for name, sel in selectors.items()
        },
        "table": {
            "cells": [[*key, value] for key, value in table.cells.items()],
            "counts": [[*key, count] for key, count in table.counts.items()],
        },
        "memory": settings,
        "points": [_to_json(dataclasses.asdict(p)) for p in points],
    }
    # Plain built-in types only (phases become plain strings): checkpoints pickle this dict.
    return json.loads(json.dumps(state))


def load_selector_state(
    selectors: dict[str, Selector], state: dict[str, Any]
) -> list[CalibrationPoint]:
    """Restore ``state`` (from ``selector_state``) into ``selectors`` in place and return its
    calibration points. The shared table and memory model stay the same objects (the memory
    model's ``settings`` is replaced). Raises ``ValueError`` naming the bad key or value, before
    anything is changed, on a wrong version, an unknown phase or a layout that is not a candidate.
    """
    if state.get("version") != VERSION:
        raise ValueError(
            f"selector state version {state.get('version')!r} is not supported; expected {VERSION}"
        )
    table, memory = _shared(selectors)
    # ---- validate and build everything first
    restored = {}
    for name, saved in state["selectors"].items():
        if name not in selectors:
            raise ValueError(
                f"selector state has phase {name!r}, which this run does not select; "
                f"selected phases: {sorted(selectors)}"
            )
        allowed = selectors[name].candidates
        where = f"selectors[{name!r}]"
        current = {
            _phase(p, f"{where}.current"): _layout(lay, allowed, f"{where}.current[{p!r}]")
            for p, lay in saved["current"].items()
        }
        infeasible = {
            (_phase(p, f"{where}.infeasible"), _layout(lay, allowed, f"{where}.infeasible"), b)
            for p, lay, b in saved["infeasible"]
        }
        history = {p: [] for p in PHASES}
        for p, lengths in saved["history"].items():
            history[_phase(p, f"{where}.history")] = [int(n) for n in lengths]
        layouts = {p: ParallelLayout.parse(lay) for p, lay in current.items()}
        restored[name] = (layouts, infeasible, history)
    union = [c for sel in selectors.values() for c in sel.candidates]
    rows = {}
    for part in ("cells", "counts"):
        rows[part] = {}
        for p, lay, bucket, value in state["table"][part]:
            _phase(p, f"table.{part}")
            allowed = selectors[p].candidates if p in selectors else union
            rows[part][(p, _layout(lay, allowed, f"table.{part}[{p!r}]"), bucket)] = value
    settings = _decode_settings(memory.settings, state["memory"])
    points = [_decode_point(raw) for raw in state["points"]]
    # ---- then apply
    for name, (current, infeasible, history) in restored.items():
        sel = selectors[name]
        sel.current.clear()
        sel.current.update(current)
        sel.infeasible.clear()
        sel.infeasible.update(infeasible)
        sel.history.clear()
        sel.history.update(history)
    table.cells.clear()
    table.cells.update(rows["cells"])
    table.counts.clear()
    table.counts.update(rows["counts"])
    memory.settings = settings
    return points


def _shared(selectors: dict[str, Selector]) -> tuple[ThroughputTable, MemoryModel]:
    """The table and memory model every selector shares (``build_selectors`` builds them so)."""
    if not selectors:
        raise ValueError("selectors is empty: nothing to save or restore")
    tables = {id(s.table) for s in selectors.values()}
    memories = {id(s.memory) for s in selectors.values()}
    if len(tables) > 1 or len(memories) > 1:
        raise ValueError(
            f"selectors {sorted(selectors)} use {len(tables)} throughput tables and "
            f"{len(memories)} memory models; the state holds one of each, shared by all"
        )
    first = next(iter(selectors.values()))
    return first.table, first.memory


def _phase(name: str, where: str) -> str:
    if name not in PHASES:
        raise ValueError(f"{where}: unknown phase {name!r}; expected one of {PHASES}")
    return name


def _layout(name: str, allowed: Sequence[Any], where: str) -> str:
    names = [str(c) for c in allowed]
    if name not in names:
        raise ValueError(
            f"{where}: layout {name!r} is not among the candidates of this run: {names}"
        )
    return name


def _to_json(value: Any) -> Any:
    """``value`` with tuples as lists, or ``_SKIP`` when it has no JSON form."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        items = [_to_json(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _to_json(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in items.values()) else items
    return _SKIP


def _from_json(hint: Any, value: Any) -> Any:
    """Undo ``_to_json`` along the type ``hint``: lists become tuples where a tuple is declared."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        kinds = {list: (list, tuple), dict: (dict,)}.get(type(value), ())
        for arg in args:
            if typing.get_origin(arg) in kinds:
                return _from_json(arg, value)
        return value
    if origin is tuple and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], v) for v in value)
        if len(args) != len(value):
            raise ValueError(f"expected {len(args)} values for {hint}, got {value!r}")
        return tuple(_from_json(a, v) for a, v in zip(args, value, strict=True))
    if origin is list and isinstance(value, list):
        return [_from_json(args[0], v) for v in value] if args else value
    if origin is dict and isinstance(value, dict):
        return {k: _from_json(args[1], v) for k, v in value.items()} if args else value
    return value


def _decode_fields(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; {cls.__name__} has {sorted(hints)}")
    return {name: _from_json(hints[name], value) for name, value in data.items()}


def _decode_settings(settings: MemorySettings, data: dict[str, Any]) -> MemorySettings:
    return dataclasses.replace(settings, **_decode_fields(MemorySettings, data, "memory"))


def _decode_point(data: dict[str, Any]) -> CalibrationPoint:
    fields = _decode_fields(CalibrationPoint, data, "points")
    required = {
        f.name
        for f in dataclasses.fields(CalibrationPoint)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = sorted(required - set(fields))
    if missing:
        raise ValueError(f"points: a calibration point lacks fields {missing}; got {data!r}")
    _phase(fields["phase"], "points")
    return CalibrationPoint(**fields)
