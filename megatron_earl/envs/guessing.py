"""A multi-turn guessing game whose context grows every turn: guess the secret number.

Task ``seed`` at ``difficulty`` d: a secret in [1, 2**d - 1]; the model answers each turn with a
number and gets ``higher`` / ``lower`` (role ``user``) until it is ``correct``. Binary search
needs at most d guesses, so the difficulty sets the number of turns; the episode ends after
``max_guesses`` (default d + 2). A turn without a number gets ``invalid`` and costs a guess.
Reward 1 when found, else 0. The demonstration is the binary search.

    user:      guess 1-7
    assistant: 4          user: lower
    assistant: 2          user: higher
    assistant: 3          (done, reward 1)
"""

from __future__ import annotations

import random

from megatron_earl.envs.base import ENVS, Action, Environment, ResetResult, StepResult
from megatron_earl.envs.tool_env import last_number
from megatron_earl.tokenizer.base import Message


@ENVS.register("guessing")
class GuessingEnv(Environment):
    """Higher/lower guessing game."""

    def __init__(self, difficulty: int = 3, max_guesses: int | None = None) -> None:
        if not 1 <= difficulty <= 16:
            raise ValueError(
                f"difficulty must be in [1, 16] (bits of the secret), got {difficulty}"
            )
        self.difficulty = difficulty
        self.high = 2**difficulty - 1
        self.max_guesses = difficulty + 2 if max_guesses is None else max_guesses
        if self.max_guesses < 1:
            raise ValueError(f"max_guesses must be >= 1, got {self.max_guesses}")
        self.secret = 0
        self.num_guesses = 0

    def _secret(self, seed: int) -> int:
        return random.Random(f"guessing:{self.difficulty}:{seed}").randint(1, self.high)

    def _prompt(self) -> list[Message]:
        return [{"role": "user", "content": f"guess 1-{self.high}"}]

    async def reset(self, seed: int) -> ResetResult:
        self.secret, self.num_guesses = self._secret(seed), 0
        return ResetResult(self._prompt(), {"secret": self.secret, "max_guesses": self.max_guesses})

    async def step(self, action: Action) -> StepResult:
        self.num_guesses += 1
        guess = last_number(action.text)
        info = {"guesses": self.num_guesses}
        if guess == self.secret:
            return StepResult(None, 1.0, True, info)
        if self.num_guesses >= self.max_guesses:
            return StepResult(None, 0.0, True, {**info, "out_of_guesses": True})
        if guess is None:
            feedback = "invalid"
        else:
            feedback = "higher" if guess < self.secret else "lower"
        return StepResult(feedback, 0.0, False, info, role="user")

    def demonstration(self, seed: int) -> list[Message]:
        secret, lo, hi = self._secret(seed), 1, self.high
        turns = self._prompt()
        while True:
            mid = (lo + hi) // 2
            turns.append({"role": "assistant", "content": str(mid)})
            if mid == secret:
                return turns
            turns.append({"role": "user", "content": "higher" if mid < secret else "lower"})
            lo, hi = (mid + 1, hi) if mid < secret else (lo, mid - 1)
