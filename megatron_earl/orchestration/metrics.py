"""Per-step metrics: JSONL (one line per step, flat keys) and TensorBoard, plus a phase timer.

    timer = PhaseTimer()
    with timer.phase(Phase.ROLLOUT):
        ...
    with MetricsLogger(cfg.run_dir, tensorboard=True, enabled=rank == 0) as log:
        log.log(step, {"reward": {"mean": 0.4}, **timer.metrics(), "layout/train": "tp2cp1pp1dp1"})

Keys are flat strings with ``/`` between levels (nested dicts are flattened: ``{"reward":
{"mean": x}}`` -> ``reward/mean``); the keys the RL loop writes and ``megatron-earl plot`` reads are
listed in ``docs/metrics.md``. Values: numbers (0-d tensors and numpy scalars become Python
numbers), strings (layouts) and None. Non-finite floats are written as the strings ``"nan"``,
``"inf"``, ``"-inf"`` so every line is strict JSON; ``read_metrics`` turns them back into floats.

TensorBoard (``torch.utils.tensorboard``) needs the optional ``tensorboard`` package
(``pip install 'megatron-earl[tensorboard]'``); without it the logger warns once and writes JSONL
only. Numbers become scalars; strings become text, written when they change.

Resume: ``MetricsLogger(..., resume_step=k)`` first drops the lines of steps after ``k`` (steps a
crashed run wrote after its last checkpoint, which the resumed run redoes), so the file holds each
step once. Everything here is local file I/O on the ranks that enable it (rank 0): no collectives.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flat ``{"a/b": value}`` of nested mappings, values made JSON-ready (see module docstring)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, f"{name}/"))
        else:
            out[name] = _plain(value, name)
    return out


def _plain(value: Any, name: str) -> Any:
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(f"metric {name!r} is not a scalar: shape {shape}") from None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if type(value).__name__ == "ParallelLayout":
        return str(value)
    raise ValueError(
        f"metric {name!r} has a {type(value).__name__} value {value!r}; "
        "valid: numbers, strings, None, 0-d tensors or nested dicts of those"
    )


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file (a torn last line from a crash is skipped)."""
    lines = Path(path).read_text().splitlines()
    records = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {index + 1} is not JSON: {line[:80]!r}") from None
        records.append({k: _from_json(v) for k, v in record.items()})
    return records


def _from_json(value: Any) -> Any:
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Keep only the records with ``step <= last_step`` (atomic rewrite); returns records kept."""
    path = Path(path)
    if not path.exists():
        return 0
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(flatten_metrics(r)) + "\n" for r in kept))
    tmp.replace(path)
    return len(kept)


class MetricsLogger:
    """Writes one record per step to ``<run_dir>/metrics.jsonl`` and TensorBoard."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        jsonl: bool = True,
        tensorboard: bool = True,
        tensorboard_dir: str | Path | None = None,
        enabled: bool = True,
        resume_step: int | None = None,
    ) -> None:
        """``enabled=False`` (ranks other than 0) makes every call a no-op."""
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._tb = None
        self._last_text: dict[str, str] = {}
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
        if jsonl:
            self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            self._tb = _summary_writer(Path(tensorboard_dir or Path(run_dir) / "tensorboard"))

    @property
    def tensorboard_active(self) -> bool:
        return self._tb is not None

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Write the step's metrics (stored with ``"step": step``); returns the flat record."""
        record = {"step": step, **flatten_metrics(metrics)}
        if not self.enabled:
            return record
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key == "step" or value is None:
                    continue
                if isinstance(value, str) and value not in _NON_FINITE:
                    if self._last_text.get(key) != value:
                        self._tb.add_text(key, value, step)
                        self._last_text[key] = value
                else:
                    self._tb.add_scalar(key, _NON_FINITE.get(value, value), step)
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary_writer(log_dir: Path):
    """A TensorBoard ``SummaryWriter``, or None (with one warning) without ``tensorboard``."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard raises ImportError when tensorboard is missing
        warnings.warn(
            "TensorBoard logging is off: the 'tensorboard' package is not installed "
            "(pip install 'megatron-earl[tensorboard]'); metrics still go to metrics.jsonl",
            stacklevel=3,
        )
        return None
    return SummaryWriter(log_dir=str(log_dir))


class PhaseTimer:
    """Wall-clock seconds per phase of one step: ``time/<phase>`` metrics. Create (or ``reset``)
    at the start of each step."""

    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._start = clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body; repeated phases in one step add up."""
        start = self._clock()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + self._clock() - start

    def metrics(self) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` plus ``time/step``: wall time since the start/reset."""
        out = {f"time/{k}": v for k, v in self._seconds.items()}
        out["time/step"] = self._clock() - self._start
        return out

    def reset(self) -> None:
        self._seconds.clear()
        self._start = self._clock()
