"""The engine protocol the agent loop drives: token-in/token-out generation with log-probs.

Implementations: the embedded engine (the Megatron model itself, in the rollout layout), and the
SGLang client (one or many SGLang servers over SGLang's native HTTP API). The agent loop never
re-tokenizes model output: it keeps ``output_ids`` exactly as sampled, with their log-probs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from megatron_earl.config.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


class FinishType(str, enum.Enum):
    """Why generation stopped (SGLang's ``meta_info.finish_reason.type``)."""

    STOP = "stop"
    """A stop token id or stop string matched (``matched`` says which)."""
    LENGTH = "length"
    """``max_new_tokens`` or the context limit was reached."""
    ABORT = "abort"
    """The request was aborted (client abort, weight update with abort, engine failure)."""


@dataclass(frozen=True)
class FinishReason:
    type: FinishType
    """Category of the stop."""
    matched: int | str | None = None
    """The stop token id or stop string that matched (STOP only)."""
    message: str | None = None
    """Why it was aborted (ABORT only)."""


@dataclass(frozen=True)
class GenerateRequest:
    """One generation call: continue ``input_ids`` (the whole context so far)."""

    input_ids: tuple[int, ...]
    """Prompt/context token ids."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling settings."""
    rid: str = ""
    """Request id (for abort and routing); the engine assigns one when empty."""
    session: str | None = None
    """Trajectory id: engine pools route a session to the same engine (prefix cache)."""
    logprob_start_len: int = -1
    """Prompt position from which the prompt tokens' log-probs are returned (SGLang's
    ``logprob_start_len``; -1: none). Costs the logits of those positions in the prefill."""
    top_logprobs_num: int = 0
    """Most likely tokens returned with their log-probs at each returned position (prompt
    positions from ``logprob_start_len``, every output token); 0: none."""
    return_routed_experts: bool = False
    """Return the experts each computed position was routed to (mixture-of-experts models;
    SGLang's ``return_routed_experts``, which needs ``--enable-return-routed-experts``)."""
    routed_experts_start_len: int = 0
    """First position whose routes are returned (SGLang's ``routed_experts_start_len``): a
    multi-turn caller that holds the routes of the earlier positions asks for the rest."""


TopLogprobs = tuple[tuple[float, int], ...]
"""(log-prob, token id) pairs of one position, most likely first (same distribution as
``output_logprobs``: the raw logits over the padded vocabulary; ids of the real vocabulary)."""


@dataclass(frozen=True)
class GenerateResult:
    """What one generation call produced."""

    rid: str
    """Request id."""
    output_ids: tuple[int, ...]
    """Sampled token ids, exactly as sampled."""
    output_logprobs: tuple[float, ...]
    """log p(token) of each sampled token under the sampling policy (before temperature)."""
    finish_reason: FinishReason
    """Why generation stopped."""
    weight_version: int
    """Policy version (weights) that produced the tokens."""
    prompt_tokens: int = 0
    """Length of ``input_ids``."""
    cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache."""
    input_logprobs: tuple[float, ...] = ()
    """log p(input_ids[i] | input_ids[:i]) for i = logprob_start_len + 1 .. len(input_ids) - 1
    (SGLang's ``meta_info.input_token_logprobs`` without its leading null); empty when not
    asked."""
    input_top_logprobs: tuple[TopLogprobs, ...] = ()
    """The ``top_logprobs_num`` most likely tokens at the positions of ``input_logprobs``."""
    output_top_logprobs: tuple[TopLogprobs, ...] = ()
    """The ``top_logprobs_num`` most likely tokens at each output position."""
    routed_experts: torch.Tensor | None = field(default=None, compare=False)
    """``return_routed_experts``: ``[rows, MoE layers, topk]`` int32 on the host, the experts of
    every position from ``routed_experts_start_len`` whose forward ran, cached prefix included:
    n - 1 - start rows after generation (n = prompt + output tokens; the last token is never
    fed), n - start for a prompt-only request -- SGLang's ``meta_info.routed_experts``; None
    when not asked."""


class EngineError(RuntimeError):
    """The engine failed (unreachable, crashed, rejected the request)."""


class RequestError(ValueError):
    """A request the embedded engine cannot serve as given (bad ids, too long); the message says
    why (``serve`` answers it with a 400)."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine the agent loop can drive concurrently from one asyncio loop."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate a continuation; raises ``EngineError`` when the engine fails."""
        ...

    async def abort(self, rid: str) -> None:
        """Abort a running request (its result comes back with finish type ABORT)."""
        ...

    async def health(self) -> bool:
        """True when the engine can generate."""
        ...

    @property
    def weight_version(self) -> int:
        """Version of the weights currently served."""
        ...
