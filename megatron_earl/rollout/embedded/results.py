"""What a step's logits become, for the embedded engine's scheduler (``embedded.py``): one
sampled token per request, its log-prob (and top log-probs when asked), the prompt log-probs of
a prefill that computes them, stop checks, and the requests retired -- finished, or failed
alone (a sampling or stop-check error, a non-finite log-prob) -- with their rows released.

``StepResults`` is a mixin of ``EmbeddedEngine`` (scheduler rank only; the step's logits on the
device, sampled there, results read back in one transfer; no communication); ``EngineRequest``
is the scheduler's record of one request.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_earl import runtime
from megatron_earl.rollout.embedded.sampling import host_to, sample_tokens
from megatron_earl.rollout.engine import (
    EngineError,
    FinishReason,
    FinishType,
    GenerateRequest,
    GenerateResult,
)


@dataclass
class EngineRequest:
    request: GenerateRequest
    future: asyncio.Future
    generator: random.Random
    rid: str
    """The request's id: ``request.rid``, or the one the engine gave it (read this, not
    ``request.rid``, which stays empty for a request that came without one)."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    abort_message: str | None = None
    cached_tokens: int = 0
    """Context tokens taken over from the session's parked row (not prefilled again)."""
    kv_version: int = -1
    """Weight version its keys and values were computed with (prefill at admission); a row
    whose prefix predates a weight update is not parked for reuse."""
    top_k: int = 0
    """``request.top_logprobs_num``."""
    progress: Callable[[str, int, float], None] | None = None
    """Called with (rid, token, log-prob) for each token but the last (streaming)."""
    extras: bool = False
    """``top_k`` or ``progress`` set: the one test a token pays on the default path."""
    input_logprobs: list[float] | None = None
    """Prompt log-probs (``request.logprob_start_len``), set by the prefill that computes them."""
    input_top: list = field(default_factory=list)
    output_top: list = field(default_factory=list)
    routed_experts: torch.Tensor | None = None
    """``request.return_routed_experts``: its routes, read from the cache row when it retires."""

    @property
    def context(self) -> tuple[int, ...]:
        return tuple(self.request.input_ids) + tuple(self.output_ids)


class StepResults:
    """The results half of ``EmbeddedEngine`` (module docstring)."""

    def _prompt_logprobs(
        self, logits: torch.Tensor, ends: list[int], seq_of: list[int], entries: list[EngineRequest]
    ) -> dict[int, str]:
        """Set the prompt log-probs (and top log-probs) of the entries that asked, from their
        sequence's logit rows ``[end - (len - start), end - 1)`` (positions ``start .. len-2``
        predict tokens ``start+1 .. len-1``; those rows cross to the host: asked for, not on the
        default path); returns {entry index: why it failed}."""
        failed: dict[int, str] = {}
        done: dict[tuple[int, int], tuple] = {}  # (sequence, top_k) -> result: shared prefills
        for i, entry in enumerate(entries):
            start = prompt_start(entry)
            if start is None:
                continue
            prompt, s = entry.request.input_ids, seq_of[i]
            key = (s, entry.top_k)
            try:
                if key not in done:
                    rows = runtime.to_host(logits[ends[s] - (len(prompt) - start) : ends[s] - 1])
                    done[key] = self._logprobs_at(rows, prompt[start + 1 :], entry.top_k)
                entry.input_logprobs, entry.input_top = done[key]
            except Exception as err:
                failed[i] = f"prompt log-probs failed: {err}"
        return failed

    def _logprobs_at(self, logits_mV: torch.Tensor, targets: Sequence[int], top_k: int) -> tuple:
        """log p(targets[j]) under row j (raw logits over the real vocabulary, as the sampled
        tokens' log-probs) and each row's ``top_k`` most likely tokens."""
        logprobs = torch.log_softmax(logits_mV[:, : self.model_config.vocab_size].float(), dim=-1)
        values = logprobs.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0]
        if not bool(torch.isfinite(values).all()):
            raise ValueError("non-finite logits")
        top = _top_logprobs(logprobs, self.model_config.vocab_size, top_k) if top_k else []
        return values.tolist(), top

    def _accept(
        self,
        logits: torch.Tensor,
        entries: list[EngineRequest],
        ended: dict[int, FinishReason | str] | None = None,
    ) -> None:
        """Sample one token per entry (logits row i = entries[i]) and retire the finished; a
        finished request with a session parks its row for the session's next turn. A request
        whose sampling or stop check raises, or whose log-prob is not finite, fails alone.
        ``ended``: entries (index) retired as they are, without a token (a finish reason, or a
        message: failed)."""
        # Sampling runs where the logits are, with each request's own seeded host stream for
        # its draw (``sampling``): the ids and log-probs cross in one small read (boundary
        # "sampled tokens -> environment", docs/devices.md); the logits never do.
        try:
            drawn = list(zip(*self._sample(logits, entries), strict=True))
        except Exception:
            drawn = [self._sample_alone(logits[i : i + 1], e) for i, e in enumerate(entries)]
        done: list[tuple[EngineRequest, FinishReason | str]] = []
        tops: list[int] = []  # rows of entries that want their output top log-probs
        for row, (entry, (token, logprob)) in enumerate(zip(entries, drawn)):
            if ended and row in ended:
                done.append((entry, ended[row]))
                continue
            if token is None:
                done.append((entry, f"sampling failed: {logprob}"))
                continue
            if not math.isfinite(logprob):
                done.append((entry, f"non-finite logits (log-prob {logprob}) at this step"))
                continue
            entry.output_ids.append(token)
            entry.logprobs.append(logprob)
            try:
                reason = self._finish_reason(entry)
                if entry.extras:
                    if entry.top_k:
                        tops.append(row)
                    if entry.progress is not None and reason is None:
                        entry.progress(entry.rid, token, logprob)
            except Exception as err:
                reason = f"stop check or progress failed: {err!r}"
            if reason is not None:
                done.append((entry, reason))
        if tops and (failed := self._output_top_logprobs(logits, tops, entries)):
            gone = {id(entry) for entry, _ in failed}  # retired once, with the failure
            done = [d for d in done if id(d[0]) not in gone] + failed
        if done:
            self._retire(done)

    def _output_top_logprobs(
        self, logits: torch.Tensor, rows: list[int], entries: list[EngineRequest]
    ) -> list[tuple[EngineRequest, str]]:
        """Append each entry's top log-probs of this step (``rows`` of ``logits``, which cross
        to the host: asked for, not on the default path); the entries whose computation fails
        are returned to be retired with the message."""
        try:
            k = max(entries[r].top_k for r in rows)
            index = host_to(torch.tensor(rows, dtype=torch.long), logits.device)
            real = runtime.to_host(logits[index])[:, : self.model_config.vocab_size]
            logprobs = torch.log_softmax(real.float(), dim=-1)
            top = _top_logprobs(logprobs, self.model_config.vocab_size, k)
        except Exception as err:
            return [(entries[r], f"top log-probs failed: {err!r}") for r in rows]
        for r, pairs in zip(rows, top):
            entries[r].output_top.append(pairs[: entries[r].top_k])
        return []

    def _sample(self, logits: torch.Tensor, entries: list[EngineRequest]) -> tuple[list, list]:
        params = [e.request.sampling for e in entries]
        generators = [e.generator for e in entries]
        return sample_tokens(logits, self.model_config.vocab_size, params, generators)

    def _sample_alone(self, logits: torch.Tensor, entry: EngineRequest) -> tuple[int | None, Any]:
        try:
            (token,), (logprob,) = self._sample(logits, [entry])
        except Exception as err:
            return None, repr(err)
        return token, logprob

    def _retire(self, done: list[tuple[EngineRequest, FinishReason | str]]) -> None:
        """Release the rows of finished (a ``FinishReason``) and failed (a message) requests,
        last row first; a finished request's session keeps its row parked when its keys and
        values are of the current weights."""
        table = self._table
        row_of = {id(e): r for r, e in enumerate(table.items)}
        ordered = sorted(done, key=lambda d: -row_of[id(d[0])])
        # the finished requests' routes, read (in one transfer) before any row is released
        routed = [
            e
            for e, reason in ordered
            if e.request.return_routed_experts and not isinstance(reason, str)
        ]
        spans = []
        for entry in routed:
            row = row_of[id(entry)]
            end = table.lengths[row]
            spans.append((row, min(entry.request.routed_experts_start_len, end), end))
        if spans:
            read = self._forward.cache.read_routes(spans)
            for entry, routes in zip(routed, read, strict=True):
                entry.routed_experts = routes
        for entry, reason in ordered:
            row, session = row_of[id(entry)], entry.request.session
            if isinstance(reason, str):
                table.release(row)
                self._fail(entry, reason)
                continue
            cached = entry.context[: table.lengths[row]]
            fresh = session is not None and entry.kv_version == self._version
            table.release(row, (session, cached) if fresh else None)
            self._finish(entry, reason)

    def _finish_reason(self, entry: EngineRequest) -> FinishReason | None:
        sampling, token = entry.request.sampling, entry.output_ids[-1]
        if token in sampling.stop_token_ids:
            return FinishReason(FinishType.STOP, matched=token)
        if sampling.stop:
            text = self.detokenize(entry.output_ids)
            for stop in sampling.stop:
                if stop in text:
                    return FinishReason(FinishType.STOP, matched=stop)
        if len(entry.output_ids) >= sampling.max_new_tokens:
            return FinishReason(FinishType.LENGTH, matched=None)
        if len(entry.request.input_ids) + len(entry.output_ids) >= self.config.max_seq_len:
            return FinishReason(FinishType.LENGTH)
        return None

    def _fail(self, entry: EngineRequest, message: str) -> None:
        if not entry.future.done():
            entry.future.set_exception(EngineError(f"request {entry.rid!r} failed: {message}"))

    def _finish(self, entry: EngineRequest, reason: FinishReason) -> None:
        if entry.future.done():
            return
        req = entry.request
        entry.future.set_result(
            GenerateResult(
                rid=entry.rid,
                output_ids=tuple(entry.output_ids),
                output_logprobs=tuple(entry.logprobs),
                finish_reason=reason,
                weight_version=self._version,
                prompt_tokens=len(req.input_ids),
                cached_tokens=entry.cached_tokens,
                input_logprobs=tuple(entry.input_logprobs or ()),
                input_top_logprobs=tuple(entry.input_top),
                output_top_logprobs=tuple(entry.output_top),
                routed_experts=entry.routed_experts,
            )
        )


def prompt_start(entry: EngineRequest) -> int | None:
    """First prompt position whose logits the request's prefill must return (its prompt
    log-probs), or None: not asked, nothing to compute (start >= len - 1), or already computed
    (a retracted request prefilled again)."""
    start = entry.request.logprob_start_len
    if 0 <= start < len(entry.request.input_ids) - 1 and entry.input_logprobs is None:
        return start
    return None


def _top_logprobs(logprobs_mV: torch.Tensor, vocab_size: int, k: int) -> list[tuple]:
    """Per row, the ``k`` most likely real-vocabulary tokens as ((log-prob, id), ...)."""
    values, ids = logprobs_mV[:, :vocab_size].topk(min(k, vocab_size), dim=-1)
    return [tuple(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
