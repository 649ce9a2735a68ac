"""A benchmark environment whose episodes have a long-tailed number of turns (``longtail``).

Task ``seed``: a number of turns n drawn, seeded by the task, from a lognormal (median
``scale``, log-sigma ``shape``) or a Pareto (minimum ``scale``, tail index ``shape``) clipped to
[1, ``max_turns``]; each turn asks the model to say a number and the model answers it. The
episode ends after n answers; reward = the fraction answered right (the answer's last number).
So the generated tokens of a trajectory follow the turn distribution (a few tokens per turn
after the SFT warm start on ``demonstration``) and the context grows every turn: the long tail
of agentic rollouts (the slowest trajectory many times the median) that async RL is measured
on (docs/async.md). The numbers have ``digits`` digits (zero-padded), so with a per-digit
tokenizer (the demo's) a right turn is ``digits`` + 1 tokens (the stop token): generated tokens =
turns x (digits + 1). ``tool_latency_s`` adds a fixed tool/environment time to every step.

    user:      say 37
    assistant: 37          user: say 05
    assistant: 05          (n = 2: done, reward 1)

    ENVS.build({"name": "longtail", "kwargs": {"scale": 2, "shape": 1.0, "max_turns": 16}})
    LongTailEnv(scale=2, shape=1.0).turn_distribution()   # p50/p90/p99/max over 10,000 tasks

Set ``rollout.max_turns`` >= ``max_turns`` or the agent loop cuts the tail (``MAX_TURNS``).
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from megatron_earl.envs.base import ENVS, Action, Environment, ResetResult, StepResult
from megatron_earl.envs.tool_env import last_number
from megatron_earl.tokenizer.base import Message

DISTRIBUTIONS = ("lognormal", "pareto")
"""Turn-count distributions ``LongTailEnv`` draws from."""


@ENVS.register("longtail")
class LongTailEnv(Environment):
    """Say-the-number episodes with a seeded, long-tailed number of turns."""

    def __init__(
        self,
        distribution: str = "lognormal",
        scale: float = 2.0,
        shape: float = 1.0,
        max_turns: int = 16,
        tool_latency_s: float = 0.0,
        digits: int = 2,
    ) -> None:
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if not (
            scale >= 1
            and shape > 0
            and max_turns >= 1
            and tool_latency_s >= 0
            and 1 <= digits <= 12
        ):
            raise ValueError(
                f"longtail needs scale >= 1 turn, shape > 0, max_turns >= 1, tool_latency_s >= "
                f"0, digits in [1, 12]; got scale={scale}, shape={shape}, max_turns={max_turns}, "
                f"tool_latency_s={tool_latency_s}, digits={digits}"
            )
        self.digits = digits
        self.distribution = distribution
        self.scale, self.shape, self.max_turns = scale, shape, max_turns
        self.tool_latency_s = tool_latency_s
        self.numbers: list[int] = []
        self.turn = 0
        self.num_right = 0

    def task(self, seed: int) -> list[int]:
        """The numbers of task ``seed``, one per turn (their count is the turn count)."""
        rng = random.Random(f"longtail:{self.distribution}:{self.scale}:{self.shape}:{seed}")
        if self.distribution == "lognormal":
            x = self.scale * math.exp(rng.gauss(0.0, self.shape))
        else:
            x = self.scale * rng.paretovariate(self.shape)
        n = min(self.max_turns, max(1, round(x)))
        return [rng.randrange(10**self.digits) for _ in range(n)]

    def _say(self, number: int) -> str:
        return f"{number:0{self.digits}d}"

    def turn_distribution(self, num_tasks: int = 10000) -> dict[str, Any]:
        """The turn counts of tasks 0..num_tasks-1: the settings and p50/p90/p99/max/mean
        (``tokens_per_turn``: of a right answer with a per-digit tokenizer)."""
        turns = sorted(len(self.task(seed)) for seed in range(num_tasks))

        def q(p: float) -> int:
            return turns[min(num_tasks - 1, int(p * num_tasks))]

        return {
            "distribution": self.distribution,
            "scale": self.scale,
            "shape": self.shape,
            "max_turns": self.max_turns,
            "tokens_per_turn": self.digits + 1,
            "num_tasks": num_tasks,
            "mean": sum(turns) / num_tasks,
            "p50": q(0.5),
            "p90": q(0.9),
            "p99": q(0.99),
            "max": turns[-1],
        }

    async def reset(self, seed: int) -> ResetResult:
        self.numbers, self.turn, self.num_right = self.task(seed), 0, 0
        prompt = [{"role": "user", "content": f"say {self._say(self.numbers[0])}"}]
        return ResetResult(prompt, {"turns": len(self.numbers)})

    async def step(self, action: Action) -> StepResult:
        if self.tool_latency_s:
            await asyncio.sleep(self.tool_latency_s)
        right = last_number(action.text) == self.numbers[self.turn]
        self.num_right += right
        self.turn += 1
        reward = float(right) / len(self.numbers)
        info = {"turn": self.turn, "num_right": self.num_right}
        if self.turn == len(self.numbers):
            return StepResult(None, reward, True, info)
        next_turn = f"say {self._say(self.numbers[self.turn])}"
        return StepResult(next_turn, reward, False, info, role="user")

    def demonstration(self, seed: int) -> list[Message]:
        numbers = self.task(seed)
        turns: list[Message] = [{"role": "user", "content": f"say {self._say(numbers[0])}"}]
        for i, number in enumerate(numbers):
            turns.append({"role": "assistant", "content": self._say(number)})
            if i + 1 < len(numbers):
                turns.append({"role": "user", "content": f"say {self._say(numbers[i + 1])}"})
        return turns
