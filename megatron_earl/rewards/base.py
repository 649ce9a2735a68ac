"""Rewards of a trajectory: the environment's outcome reward, an optional format reward, and
any number of extra reward functions (local callables or the HTTP reward service).

The total is ``outcome + format_weight * format + sum(weight_i * reward_i)``; every component
is kept by name in ``Trajectory.rewards``. A reward function receives a ``RewardInput`` (plain
JSON-serialisable data, so it can cross a process boundary) and returns a float.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from megatron_earl.tools.parser import parse_tool_calls


@dataclass
class RewardInput:
    """What a reward function sees of a finished trajectory."""

    uid: str
    """Trajectory id (group/sample)."""
    seed: int
    """Task seed."""
    task: dict[str, Any]
    """Task info from the environment's ``reset`` (e.g. the target answer)."""
    turns: list[str]
    """Decoded text of each model turn (stop token removed)."""
    outcome: float
    """The environment's outcome reward."""
    end_reason: str
    """Why the trajectory ended."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else (last step info)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class RewardFn(Protocol):
    """An async reward function; ``name`` keys its component in ``Trajectory.rewards``."""

    name: str

    async def __call__(self, inp: RewardInput) -> float: ...


def format_reward(turn_texts: Sequence[str], stopped: Sequence[bool]) -> float:
    """Fraction of model turns that are well-formed: ended with a stop token and, when they
    contain tool calls, every ``<tool_call>`` block parses (valid JSON with name/arguments).
    0 for a trajectory without turns."""
    if not turn_texts:
        return 0.0
    good = sum(bool(s) and not parse_tool_calls(t).errors for t, s in zip(turn_texts, stopped))
    return good / len(turn_texts)


@dataclass(frozen=True)
class WeightedReward:
    """A reward function and its weight in the total."""

    fn: RewardFn
    weight: float = 1.0
