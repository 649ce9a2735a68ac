"""Calculator-tool arithmetic: a multi-step expression the model must compute with the tool.

Task ``seed`` at ``difficulty`` d: an expression of d+1 single-digit numbers joined by d
operators from ``+ - *`` (operator precedence matters from d=2 on), e.g. ``3+4*2``. The ideal
episode, two model turns:

    user:      3+4*2
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "3+4*2"}}</tool_call>
    tool:      <tool_response>11</tool_response>
    assistant: 11

Reward 1 when the final answer (its last number) equals the value and the calculator was called
successfully first (``require_tool``), else 0. Short in the demo tokenizer (~25 model tokens).
"""

from __future__ import annotations

import random
from typing import Any

from megatron_earl.envs.base import ENVS
from megatron_earl.envs.tool_env import ToolEnv, last_number
from megatron_earl.tokenizer.base import Message
from megatron_earl.tools.base import ToolResult
from megatron_earl.tools.calculator import Calculator, evaluate, format_number
from megatron_earl.tools.parser import format_tool_call, format_tool_responses


def make_expression(seed: int, difficulty: int) -> str:
    """The expression of task ``seed`` (deterministic)."""
    rng = random.Random(f"arithmetic:{difficulty}:{seed}")
    parts = [str(rng.randint(1, 9))]
    for _ in range(difficulty):
        parts += [rng.choice("+-*"), str(rng.randint(1, 9))]
    return "".join(parts)


@ENVS.register("arithmetic")
class ArithmeticEnv(ToolEnv):
    """Multi-step arithmetic with a calculator tool."""

    def __init__(
        self, difficulty: int = 2, require_tool: bool = True, tool_timeout_s: float = 5.0
    ) -> None:
        if not 1 <= difficulty <= 8:
            raise ValueError(
                f"difficulty must be in [1, 8] (operators per expression), got {difficulty}"
            )
        super().__init__([Calculator(timeout_s=tool_timeout_s)], require_tool=require_tool)
        self.difficulty = difficulty

    def make_task(self, seed: int) -> tuple[list[Message], dict[str, Any]]:
        expr = make_expression(seed, self.difficulty)
        target = format_number(evaluate(expr))
        return [{"role": "user", "content": expr}], {"expression": expr, "target": target}

    def score(self, answer: str) -> float:
        value = last_number(answer)
        return float(value is not None and value == float(self.task["target"]))

    def demonstration(self, seed: int) -> list[Message]:
        prompt, task = self.make_task(seed)
        call = format_tool_call("calculator", {"expression": task["expression"]})
        response = format_tool_responses([ToolResult("calculator", task["target"])])
        return [
            *prompt,
            {"role": "assistant", "content": call},
            {"role": "tool", "content": response},
            {"role": "assistant", "content": task["target"]},
        ]
