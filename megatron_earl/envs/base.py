"""The environment API: async, gym-like, one instance per trajectory.

    env = ENVS.build({"name": "arithmetic", "kwargs": {"difficulty": 2}})
    first = await env.reset(seed)             # ResetResult: the prompt (messages or token ids)
    result = await env.step(Action(text, ids))  # StepResult: observation, reward, done, info

``reset`` returns the prompt as chat messages (rendered by the agent loop's tokenizer) or as
token ids (used verbatim). ``step`` receives the model's turn as text (stop token removed) and
as the exact sampled ids, and returns the next observation as text (rendered as a chat turn of
``role``) or as token ids (appended verbatim), a reward (summed over steps into the outcome
reward), ``done``, and an ``info`` dict that ends up in the trajectory.

The methods may also be plain ``def`` (blocking work included): the agent loop runs those on a
worker thread under ``env_timeout_s`` (``compat.user_threads``); an ``async def`` method
must not block the event loop.

Environments must be deterministic given the ``reset`` seed, and should provide
``demonstration(seed)``: the ideal conversation (prompt + assistant turns + observations) used
to build SFT warm-start data (``rollout.agent.sft``). Registered by name in ``ENVS``; any
dotted path ``"pkg.module:Class"`` works too.
"""

from __future__ import annotations

import math
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_earl.tokenizer.base import Message
from megatron_earl.tools.registry import Registry


@dataclass(frozen=True)
class Action:
    """One model turn as the environment sees it."""

    text: str
    """Decoded text of the turn, without the stop token."""
    token_ids: tuple[int, ...]
    """The sampled ids exactly (including the stop token when one matched)."""


@dataclass
class ResetResult:
    """Start of an episode."""

    prompt: list[Message] | list[int]
    """Chat messages (rendered with the chat template + generation prompt) or token ids."""
    info: dict[str, Any] = field(default_factory=dict)
    """Task metadata (e.g. the target answer) kept in the trajectory."""


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    observation: str | Sequence[int] | None
    """Next observation: text (a chat turn of ``role``), token ids, or None when done."""
    reward: float = 0.0
    """Reward for this step (the outcome reward is the sum over steps)."""
    done: bool = False
    """True ends the trajectory (the observation is then ignored)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Step metadata (e.g. tool-call counts)."""
    role: str = "tool"
    """Chat role of a text observation ("tool" for tool responses, "user" for feedback)."""


def check_reset_result(result: Any, vocab_size: int) -> str | None:
    """None when ``result`` is a usable ``ResetResult``, else what ``reset`` returned wrong,
    naming the value ("info=None, expected a dict")."""
    if not isinstance(result, ResetResult):
        return f"{reprlib.repr(result)}, expected a ResetResult"
    if not isinstance(result.info, dict):
        return f"info={reprlib.repr(result.info)}, expected a dict"
    prompt = result.prompt
    if (
        isinstance(prompt, list)
        and prompt
        and (
            all(isinstance(m, dict) for m in prompt)
            or all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt)
        )
    ):
        return None
    return (
        f"prompt={reprlib.repr(prompt)}, expected chat messages or token ids in [0, {vocab_size}), "
        "at least one"
    )


def check_step_result(result: Any, vocab_size: int) -> str | None:
    """None when ``result`` is a usable ``StepResult``, else what ``step`` returned wrong,
    naming the value ("observation=42, expected text or token ids in [0, 320)")."""
    if not isinstance(result, StepResult):
        return f"{reprlib.repr(result)}, expected a StepResult"
    if isinstance(result.reward, bool) or not isinstance(result.reward, int | float):
        return f"reward={reprlib.repr(result.reward)}, expected a number"
    if not math.isfinite(result.reward):
        return f"reward={result.reward!r}, expected a finite number"
    if not isinstance(result.done, bool):
        return f"done={reprlib.repr(result.done)}, expected a bool"
    if not isinstance(result.info, dict):
        return f"info={reprlib.repr(result.info)}, expected a dict"
    if not isinstance(result.role, str):
        return f"role={reprlib.repr(result.role)}, expected a str"
    obs = result.observation
    if result.done or obs is None:
        return None if result.done else "observation=None with done=False, expected text or ids"
    if isinstance(obs, str):
        return None
    if not isinstance(obs, Sequence) or not all(
        isinstance(t, int) and 0 <= t < vocab_size for t in obs
    ):
        return f"observation={reprlib.repr(obs)}, expected text or token ids in [0, {vocab_size})"
    return None


class Environment(ABC):
    """One episode's state. Subclasses implement ``reset`` and ``step``."""

    @abstractmethod
    async def reset(self, seed: int) -> ResetResult:
        """Start the episode of task ``seed`` (deterministic given the seed)."""

    @abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Answer one model turn."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (processes, sockets); called once when the trajectory ends."""

    def demonstration(self, seed: int) -> list[Message]:
        """The ideal conversation for task ``seed``: the prompt messages, then alternating
        ``assistant`` turns and observation turns (their own role), ending with an assistant
        turn. Raises ``NotImplementedError`` when the environment has none."""
        raise NotImplementedError(f"{type(self).__name__} provides no demonstrations")


ENVS: Registry[Environment] = Registry("environment")
"""Registry of environment classes by name."""
