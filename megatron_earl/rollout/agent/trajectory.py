"""The trajectory: one episode as token ids, loss mask, rollout log-probs, rewards and versions.

Layout (all response lists have the same length, aligned token by token):

    prompt_ids        rendered prompt (chat template + generation prompt), loss-masked out
    response_ids      model turn | observation | model turn | observation | ... | model turn
    loss_mask         1 on sampled tokens (exactly as sampled, stop token included), 0 on
                      observation tokens (end-of-turn suffix + rendered turn + generation prompt)
    rollout_logprobs  the engine's log p of each sampled token; 0.0 where loss_mask is 0
    routed_experts    (routing replay) the experts each position of prompt_ids + response_ids
                      was routed to by the engine, ``[positions, layers, topk]`` chunks, one per
                      model turn; they cover the positions ``[0, routes_held)`` (every position
                      the engine ran: all but the last token of each turn's context + output)
    turns             per model turn: its [start, end) span in response_ids and policy version

A trajectory that ended because of a broken environment, engine or reward has
``status == FAILED``; its tokens are kept for inspection but it should not be trained on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class TrajectoryStatus(str, enum.Enum):
    OK = "ok"
    """The episode ended normally (done, or a limit was reached)."""
    FAILED = "failed"
    """The environment, the engine or a reward failed; see ``end_reason`` and ``error``."""


class EndReason(str, enum.Enum):
    """Why a trajectory stopped."""

    DONE = "done"
    """The environment said done."""
    MAX_TURNS = "max_turns"
    """``max_turns`` model turns were generated without done."""
    TURN_LENGTH = "turn_length"
    """A model turn reached ``sampling.max_new_tokens`` without a stop (an incomplete action is
    not sent to the environment)."""
    CONTEXT_LIMIT = "context_limit"
    """The next model turn or observation would not fit in ``max_context_tokens`` (the
    observation is not appended; nothing is truncated)."""
    ENV_ERROR = "env_error"
    """``reset``/``step`` raised (FAILED)."""
    ENV_TIMEOUT = "env_timeout"
    """``reset``/``step`` ran past ``env_timeout_s`` (FAILED)."""
    ENV_GARBAGE = "env_garbage"
    """``reset``/``step`` returned something unusable (FAILED)."""
    ENGINE_ERROR = "engine_error"
    """The engine raised or aborted the request (FAILED)."""
    REWARD_ERROR = "reward_error"
    """A reward function (e.g. the HTTP reward service) failed (FAILED)."""


FAILURE_REASONS = frozenset(
    {
        EndReason.ENV_ERROR,
        EndReason.ENV_TIMEOUT,
        EndReason.ENV_GARBAGE,
        EndReason.ENGINE_ERROR,
        EndReason.REWARD_ERROR,
    }
)


@dataclass(frozen=True)
class TurnRecord:
    """One model turn."""

    start: int
    """First index of the turn in ``response_ids``."""
    end: int
    """One past its last index."""
    weight_version: int
    """Policy version that generated it."""
    finish: str
    """Engine finish type (stop/length/abort)."""


@dataclass
class Trajectory:
    """One episode (see the module docstring for the layout)."""

    group_id: str
    """Prompt group; the n samples of one prompt share it."""
    sample_index: int
    """Index within the group."""
    seed: int
    """Task seed the environment was reset with."""
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    routed_experts: list[Any] = field(default_factory=list)
    """Per model turn, the routes the engine returned (int tensors ``[rows, layers, topk]``)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward components (``outcome``, ``format``, remote ones by name)."""
    reward: float = 0.0
    """Total reward (weighted sum of the components)."""
    status: TrajectoryStatus = TrajectoryStatus.OK
    end_reason: EndReason | None = None
    error: str | None = None
    """What failed, for FAILED trajectories."""
    info: dict[str, Any] = field(default_factory=dict)
    """Task info from ``reset`` plus the last step's info."""
    wall_s: float = 0.0
    """Seconds from start to end of the episode."""

    @property
    def uid(self) -> str:
        return f"{self.group_id}/{self.sample_index}"

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def weight_versions(self) -> list[int]:
        """Per model turn."""
        return [t.weight_version for t in self.turns]

    @property
    def ok(self) -> bool:
        return self.status is TrajectoryStatus.OK

    def add_model_tokens(self, ids: list[int], logprobs: list[float]) -> None:
        assert len(ids) == len(logprobs), "engine returned misaligned log-probs"
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.rollout_logprobs += logprobs

    @property
    def routes_held(self) -> int:
        """Positions (from 0) whose routed experts the trajectory holds."""
        return sum(int(chunk.shape[0]) for chunk in self.routed_experts)

    def add_routes(self, routes: Any) -> None:
        """Append a turn's routes (the rows from ``routes_held`` on)."""
        self.routed_experts.append(routes)

    def add_observation_tokens(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)

    def fail(self, reason: EndReason, error: str) -> None:
        self.status, self.end_reason, self.error = TrajectoryStatus.FAILED, reason, error

    def check(self) -> None:
        """Raise ``ValueError`` when the aligned lists disagree (an internal bug)."""
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"trajectory {self.uid}: response_ids {n}, loss_mask {len(self.loss_mask)}, "
                f"rollout_logprobs {len(self.rollout_logprobs)} differ"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (for dumps and the reward service)."""
        return {
            "uid": self.uid,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "seed": self.seed,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "weight_versions": self.weight_versions,
            "rewards": self.rewards,
            "reward": self.reward,
            "status": self.status.value,
            "end_reason": None if self.end_reason is None else self.end_reason.value,
            "error": self.error,
            "info": self.info,
            "wall_s": self.wall_s,
        }
