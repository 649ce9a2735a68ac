"""A progress bar for the RL loop on stderr: step, reward, success rate, tokens/s and ETA.

    bar = ProgressBar(total_steps=cfg.steps, start_step=resumed_step, enabled=rank == 0)
    for step in range(resumed_step + 1, cfg.steps + 1):
        ...
        bar.update(step, record)          # record: the flat metrics of the step
    bar.close()

On a terminal the line is redrawn in place; otherwise (slurm logs) a full line is printed every
``log_interval`` steps and at the last step. ETA = remaining steps x the mean seconds per step
measured in this process (a resumed run does not count the steps it did not run). Self-written,
no dependency; all text goes to one stream, on the ranks that enable it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"4m05s"``, ``"2h03m"``; ``"?"`` when unknown."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_rate(value: float) -> str:
    """``"950"``, ``"12.3k"``, ``"4.56M"``."""
    for limit, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def format_progress(
    step: int,
    total: int,
    metrics: Mapping[str, Any],
    seconds_per_step: float | None,
    width: int = 20,
) -> str:
    """One progress line (pure): bar, percent, reward, success rate, tokens/s, s/step, ETA."""
    done = min(max(step, 0), total)
    filled = int(width * done / total) if total else width
    percent = 100 * done // total if total else 100
    parts = [f"step {step}/{total} [{'#' * filled}{'.' * (width - filled)}] {percent:3d}%"]
    for key, label in (("reward/mean", "reward"), ("success_rate", "success")):
        value = metrics.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{label} {value:.3f}")
    tokens = metrics.get("tokens_per_s")
    if isinstance(tokens, int | float) and not isinstance(tokens, bool):
        parts.append(f"{format_rate(tokens)} tok/s")
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.2f} s/step")
        parts.append(f"ETA {format_duration((total - done) * seconds_per_step)}")
    else:
        parts.append("ETA ?")
    return " | ".join(parts)


class ProgressBar:
    """The RL loop's progress line (see module docstring)."""

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        stream: TextIO | None = None,
        enabled: bool = True,
        log_interval: int = 1,
        width: int = 20,
        clock=time.monotonic,
        is_tty: bool | None = None,
    ) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.log_interval = max(1, log_interval)
        self.width = width
        self._clock = clock
        self._start_time = clock()
        self._start_step = start_step
        self._tty = self.stream.isatty() if is_tty is None else is_tty
        self._last_len = 0
        self.last_line = ""

    def seconds_per_step(self, step: int) -> float | None:
        """Mean wall seconds per step run by this process so far; None before the first."""
        steps = step - self._start_step
        return (self._clock() - self._start_time) / steps if steps > 0 else None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show the state after ``step`` (1-based count of completed steps)."""
        self.last_line = format_progress(
            step, self.total, metrics, self.seconds_per_step(step), self.width
        )
        if not self.enabled:
            return
        if self._tty:
            pad = " " * max(0, self._last_len - len(self.last_line))
            self.stream.write("\r" + self.last_line + pad)
            self._last_len = len(self.last_line)
            if step >= self.total:
                self.stream.write("\n")
                self._last_len = 0
        elif step % self.log_interval == 0 or step >= self.total:
            self.stream.write(self.last_line + "\n")
        self.stream.flush()

    def write(self, message: str) -> None:
        """Print a message without breaking the bar (it is redrawn at the next update)."""
        if not self.enabled:
            return
        if self._tty and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self._last_len = 0
        self.stream.write(message.rstrip("\n") + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the line on a terminal."""
        if self.enabled and self._tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0
