"""Python-tool task: compute a small sum by running code in the sandbox, then answer.

Task ``seed`` at ``difficulty`` d: "sum of squares 1..n" style questions with n in [2, 4d+4]
and one of three forms (squares, cubes, multiples). The ideal episode:

    user:      sum of squares 1..7
    assistant: <tool_call>{"name": "python", "arguments": {"code": "print(sum(i*i for i in range(1, 8)))"}}</tool_call>
    tool:      <tool_response>140</tool_response>
    assistant: 140

Reward 1 for the right final number after at least one successful python call. Each call is a
sandboxed process (``tools.sandbox``), so an episode costs ~0.2 s of tool time per call.
"""  # noqa: E501

from __future__ import annotations

import random
from typing import Any

from megatron_earl.envs.base import ENVS
from megatron_earl.envs.tool_env import ToolEnv, last_number
from megatron_earl.tokenizer.base import Message
from megatron_earl.tools.base import ToolResult
from megatron_earl.tools.parser import format_tool_call, format_tool_responses
from megatron_earl.tools.sandbox import PythonTool, SandboxConfig

_FORMS = (
    ("squares", "i*i"),
    ("cubes", "i*i*i"),
    ("doubles", "2*i"),
)


@ENVS.register("python_sum")
class PythonSumEnv(ToolEnv):
    """Small sums computed with the sandboxed python tool."""

    def __init__(self, difficulty: int = 1, sandbox: dict[str, Any] | None = None) -> None:
        if not 1 <= difficulty <= 8:
            raise ValueError(f"difficulty must be in [1, 8], got {difficulty}")
        super().__init__([PythonTool(SandboxConfig(**(sandbox or {})))])
        self.difficulty = difficulty

    def make_task(self, seed: int) -> tuple[list[Message], dict[str, Any]]:
        rng = random.Random(f"python_sum:{self.difficulty}:{seed}")
        word, term = rng.choice(_FORMS)
        n = rng.randint(2, 4 * self.difficulty + 4)
        target = sum(eval(term, {"i": i}) for i in range(1, n + 1))  # fixed, trusted terms
        code = f"print(sum({term} for i in range(1, {n + 1})))"
        prompt = [{"role": "user", "content": f"sum of {word} 1..{n}"}]
        return prompt, {"n": n, "form": word, "target": str(target), "code": code}

    def score(self, answer: str) -> float:
        value = last_number(answer)
        return float(value is not None and value == float(self.task["target"]))

    def demonstration(self, seed: int) -> list[Message]:
        prompt, task = self.make_task(seed)
        return [
            *prompt,
            {"role": "assistant", "content": format_tool_call("python", {"code": task["code"]})},
            {
                "role": "tool",
                "content": format_tool_responses([ToolResult("python", task["target"])]),
            },
            {"role": "assistant", "content": task["target"]},
        ]
