"""A tool-using environment: every model turn either calls tools or gives the final answer.

A turn containing ``<tool_call>`` blocks is executed (calls run concurrently, each with its
tool's timeout) and answered with ``<tool_response>`` blocks (role ``tool``); malformed calls,
unknown tools and schema failures come back as error responses the model can read and fix.
A turn without any tool call is the final answer: ``score(answer)`` gives the reward and the
episode ends. Subclasses provide the task (``make_task``) and the scoring.
"""

from __future__ import annotations

import asyncio
import re
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from megatron_earl.envs.base import Action, Environment, ResetResult, StepResult
from megatron_earl.tools.base import Tool, ToolErrorKind, ToolResult, invoke_by_name, tool_map
from megatron_earl.tools.parser import ToolCall, format_tool_responses, parse_tool_calls

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (the answer convention of the demo tasks)."""
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


class ToolEnv(Environment):
    """Tool calls until a turn without calls; that turn is scored."""

    def __init__(
        self, tools: Sequence[Tool], max_calls_per_turn: int = 4, require_tool: bool = True
    ) -> None:
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.tools = tool_map(tools)
        self.max_calls_per_turn = max_calls_per_turn
        self.require_tool = require_tool
        """An answer earns reward only after at least one successful tool call."""
        self.num_ok_calls = 0
        self.num_failed_calls = 0
        self.task: dict[str, Any] = {}

    @abstractmethod
    def make_task(self, seed: int) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """(prompt messages, task info) of task ``seed``."""

    @abstractmethod
    def score(self, answer: str) -> float:
        """Reward of a final answer for ``self.task``."""

    async def reset(self, seed: int) -> ResetResult:
        prompt, self.task = self.make_task(seed)
        self.num_ok_calls = self.num_failed_calls = 0
        return ResetResult(prompt, dict(self.task))

    async def step(self, action: Action) -> StepResult:
        parsed = parse_tool_calls(action.text)
        if not parsed.has_calls:
            correct = self.score(parsed.content)
            earned = correct if (self.num_ok_calls > 0 or not self.require_tool) else 0.0
            info = {
                "answer": parsed.content,
                "correct": correct,
                "tool_calls": self.num_ok_calls,
                "failed_tool_calls": self.num_failed_calls,
            }
            return StepResult(None, earned, True, info)
        calls = parsed.calls[: self.max_calls_per_turn]
        results: list[ToolResult] = list(await asyncio.gather(*(self._run(c) for c in calls)))
        if len(parsed.calls) > self.max_calls_per_turn:
            results.append(
                ToolResult(
                    "",
                    f"only {self.max_calls_per_turn} calls per turn are run",
                    ToolErrorKind.ERROR,
                )
            )
        self.num_ok_calls += sum(r.ok for r in results)
        self.num_failed_calls += sum(not r.ok for r in results)
        errors = [r.error.value for r in results if not r.ok]
        return StepResult(format_tool_responses(results), 0.0, False, {"tool_errors": errors})

    async def _run(self, call: ToolCall | ToolResult) -> ToolResult:
        if isinstance(call, ToolResult):
            return call
        return await invoke_by_name(self.tools, call.name, call.arguments)
