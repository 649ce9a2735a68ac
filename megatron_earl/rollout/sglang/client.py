"""Async client of one SGLang server (native HTTP API), implementing the ``Engine`` protocol.

    client = SGLangClient("http://127.0.0.1:30000", ClientConfig(api_key="..."))
    result = await client.generate(GenerateRequest(input_ids, SamplingParams(max_new_tokens=64)))

Requests follow SGLang's request dataclasses of the pinned release (``SGLANG_PINNED``;
``tests/unit/test_sglang_contract.py`` checks every body this client sends against
``sglang/srt/managers/io_struct.py`` of that wheel, through the schema fixture).
Token-in/token-out: ``input_ids`` in, ``output_ids`` + ``meta_info.output_token_logprobs`` out;
nothing is re-tokenized.

Failure handling: connection errors, timeouts and HTTP 502/503/504 are retried with exponential
backoff (``max_retries``); a 4xx is the caller's error (``EngineRequestError``, not retried);
anything else that keeps failing raises ``EngineError``, which ``EnginePool`` uses to fail a
request over to another engine. Weight versions: SGLang's are strings; this client reports the
integer ones the trainer sets (``int(version)``; a non-numeric version reads as -1).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from megatron_earl.config.vocab import MemoryTag
from megatron_earl.rollout.engine import (
    EngineError,
    FinishReason,
    FinishType,
    GenerateRequest,
    GenerateResult,
)

SGLANG_PINNED = "0.5.23"
"""The SGLang release whose request shapes this client and ``serve`` follow; its schema is the
fixture ``tests/fixtures/sglang_schema_<version>.json`` (after a change of version:
``python scripts/sglang_schema.py``, then the contract tests say what to adapt)."""

SESSION_ALREADY_OPEN = "a weight-update session is already open"
"""SGLang's answer (HTTP 400) to ``/begin_weight_update`` while a session is open."""

_RETRY_STATUS = (502, 503, 504)
ROUTER_UPSTREAM_ERROR = "call_upstream_request_error"
"""Error code of SGLang's router when the engine it chose failed mid-request (HTTP 500): the
request did not complete anywhere, so it is retried (through the router: on another engine)."""


class EngineRequestError(EngineError):
    """The server rejected the request (HTTP 4xx): retrying elsewhere would not help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class ClientConfig:
    """Timeouts, retries and credentials of an SGLang client."""

    request_timeout_s: float = 3600.0
    """Total time one generate call may take (long rollouts are slow)."""
    control_timeout_s: float = 60.0
    """Total time of a control call (health, pause, flush, weight update buckets use 10x)."""
    connect_timeout_s: float = 5.0
    """Time to open a connection."""
    max_retries: int = 3
    """Retries after the first attempt for connection errors, timeouts and HTTP 502/503/504."""
    backoff_s: float = 0.2
    """First retry delay; doubles each retry (with +-25% jitter)."""
    backoff_max_s: float = 5.0
    """Longest retry delay."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer <key>`` (SGLang's ``--api-key``)."""

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "control_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"need max_retries >= 0 and 0 <= backoff_s <= backoff_max_s, got "
                f"{self.max_retries}, {self.backoff_s}, {self.backoff_max_s}"
            )


def sampling_params_json(request: GenerateRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict of a request (only non-default fields are needed)."""
    s = request.sampling
    out: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
    }
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.stop:
        out["stop"] = list(s.stop)
    if s.min_p:
        out["min_p"] = s.min_p
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    return out


def parse_finish_reason(raw: Any) -> FinishReason:
    """SGLang's ``meta_info.finish_reason`` -> ``FinishReason``."""
    if not isinstance(raw, dict):
        return FinishReason(FinishType.ABORT, message=f"no finish reason ({raw!r})")
    kind = FinishType(raw.get("type", "abort"))
    return FinishReason(kind, matched=raw.get("matched"), message=raw.get("message"))


def parse_version(raw: Any) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return -1


def parse_generate_response(body: dict[str, Any], rid: str) -> GenerateResult:
    """A ``/generate`` response (one prompt) -> ``GenerateResult``."""
    meta = body.get("meta_info", {})
    logprobs = meta.get("output_token_logprobs") or []
    output_ids = body.get("output_ids")
    if output_ids is None:  # older servers: ids only inside the logprob triples
        output_ids = [int(entry[1]) for entry in logprobs]
    return GenerateResult(
        rid=meta.get("id", rid),
        output_ids=tuple(int(t) for t in output_ids),
        output_logprobs=tuple(float(entry[0]) for entry in logprobs),
        finish_reason=parse_finish_reason(meta.get("finish_reason")),
        weight_version=parse_version(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        # SGLang's prompt entries start with a null log-prob (the first position returned)
        input_logprobs=tuple(float(e[0]) for e in (meta.get("input_token_logprobs") or [])[1:]),
        input_top_logprobs=tuple(_tops(t) for t in (meta.get("input_top_logprobs") or [])[1:]),
        output_top_logprobs=tuple(_tops(t) for t in meta.get("output_top_logprobs") or []),
    )


def _tops(entries: Any) -> tuple[tuple[float, int], ...]:
    """One position of SGLang's top log-probs: [[logprob, id, text], ...] -> ((logprob, id),)."""
    return tuple((float(e[0]), int(e[1])) for e in entries or ())


class SGLangClient:
    """One SGLang server. Create and use it inside one event loop; ``close()`` when done."""

    def __init__(self, base_url: str, config: ClientConfig | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.config = config or ClientConfig()
        self.in_flight = 0
        """Generate calls currently outstanding on this server (the pool's load signal)."""
        self.on_request: Callable[[str, str, Any], None] | None = None
        """Called with (method, path, json body) before every request is sent (tests, tracing)."""
        self.retries = 0
        """Attempts repeated after a connection error, timeout, 502/503/504 or a router's
        upstream failure (reported in the rollout metrics)."""
        self.has_weight_update_session = True
        """Whether the server has SGLang's weight-update session (``begin_weight_update``);
        cleared when it answers 404 to it (an SGLang release that predates sessions)."""
        self._version = -1
        self._session: aiohttp.ClientSession | None = None
        self._ids = itertools.count()

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url})"

    # ------------------------------------------------------------------ Engine protocol

    @property
    def weight_version(self) -> int:
        """Last weight version this server reported (-1 before any)."""
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        rid = request.rid or f"cli-{id(self):x}-{next(self._ids)}"
        body = {
            "rid": rid,
            "input_ids": list(request.input_ids),
            "sampling_params": sampling_params_json(request),
            "return_logprob": True,
            "logprob_start_len": request.logprob_start_len,
            "stream": False,
        }
        if request.top_logprobs_num:
            body["top_logprobs_num"] = request.top_logprobs_num
        self.in_flight += 1
        try:
            out = await self._call("POST", "/generate", body, self.config.request_timeout_s)
        finally:
            self.in_flight -= 1
        result = parse_generate_response(out, rid)
        self._version = max(self._version, result.weight_version)
        return result

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_request", {"abort_all": True})

    async def health(self, retries: int = 0) -> bool:
        """True when ``/health`` answers 200 within the connect timeout (``retries`` more
        attempts after a failure)."""
        try:
            await self._call("GET", "/health", None, self.config.control_timeout_s, retries=retries)
        except EngineError:
            return False
        return True

    # ------------------------------------------------------------------ control and weights

    async def get_model_info(self) -> dict[str, Any]:
        info = await self._call("GET", "/get_model_info")
        self._version = parse_version(info.get("weight_version"))
        return info

    async def get_server_info(self) -> dict[str, Any]:
        """The server's ``/get_server_info`` (serve: its limits, pause state and the memory
        it holds or has released)."""
        return await self._call("GET", "/get_server_info")

    async def pause(self, mode: str = "retract") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self, attempts: int = 20) -> None:
        """Flush the prefix cache; SGLang answers 400 while requests are pending, so retry."""
        for attempt in range(attempts):
            try:
                await self._call("POST", "/flush_cache", None)
                return
            except EngineRequestError as err:
                if err.status != 400 or attempt == attempts - 1:
                    raise
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))

    async def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session (0.5.23 refuses ``update_weights_from_tensor``
        and ``update_weights_from_distributed`` outside one). A session left open by a push
        that died half-way (its trainer killed) is closed first: the new push owns the engine's
        weights from here on."""
        if not self.has_weight_update_session:
            return
        try:
            await self._weights_call("/begin_weight_update", {}, retries=0)
        except EngineRequestError as err:
            if err.status == 404:  # an SGLang release before sessions: updates need none
                self.has_weight_update_session = False
                return
            if SESSION_ALREADY_OPEN not in str(err):
                raise
            await self._weights_call("/end_weight_update", {}, retries=0)
            await self._weights_call("/begin_weight_update", {}, retries=0)

    async def end_weight_update(self) -> None:
        """Close the weight-update session (``begin_weight_update``)."""
        if self.has_weight_update_session:
            await self._weights_call("/end_weight_update", {}, retries=0)

    async def update_weights_from_tensor(
        self,
        serialized: Sequence[str],
        *,
        weight_version: int | None = None,
        flush_cache: bool = False,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """One bucket: ``serialized`` has one base64 payload per engine TP rank."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized),
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        out = await self._weights_call("/update_weights_from_tensor", body)
        if weight_version is not None:
            self._version = weight_version
        return out

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Ask the server's TP ranks to join the group (ranks ``rank_offset + tp_rank``). Never
        retried (a second join would block SGLang's scheduler on a rendezvous nobody hosts);
        ``timeout_s``: the HTTP wait, at most the group's timeout (SGLang's own wait for the
        group is 30 min)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weights_call(
            "/init_weights_update_group", body, retries=0, timeout_s=timeout_s
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        flush_cache: bool = False,
        load_format: str | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """One bucket; the trainer broadcasts its tensors on the group meanwhile
        (``weights.group.broadcast_bucket`` with the same ``load_format``). ``timeout_s``: the
        HTTP wait (the group's timeout bounds the broadcast it waits for)."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "load_format": load_format,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        # Never retried: the trainer broadcasts each bucket once, a second receive would wait for
        # a broadcast that never comes.
        out = await self._weights_call(
            "/update_weights_from_distributed", body, retries=0, timeout_s=timeout_s
        )
        if weight_version is not None:
            self._version = weight_version
        return out

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._weights_call("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None):
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        out = await self._weights_call("/update_weights_from_disk", body)
        if weight_version is not None:
            self._version = weight_version
        return out

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` entries along dim 0 of the served tensor ``name`` (HF
        name) as float32 values: a list of rows for a matrix, of floats for a vector (SGLang's
        answer; with data-parallel attention SGLang answers one such list per DP rank). A
        server without the endpoint answers 404; SGLang answers 400 for a model that cannot
        export its weights (e.g. Qwen2/Qwen3 in 0.5.23)."""
        body = {"name": name, "truncate_size": truncate_size}
        return await self._call("POST", "/get_weights_by_name", body)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free the engine's memory of ``tags`` (SGLang's ``kv_cache``, ``weights``,
        ``cuda_graph``; None: all) for colocated training; the engine must be idle and is
        started with ``--enable-memory-saver`` (SGLang)."""
        await self._memory_call("/release_memory_occupation", tags)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Rebuild the memory of ``tags`` (None: all). SGLang users resume ``weights``, push
        the new weights, then resume ``kv_cache`` (and ``cuda_graph``)."""
        await self._memory_call("/resume_memory_occupation", tags)

    async def _memory_call(self, path: str, tags: Sequence[str] | None) -> None:
        names = None if tags is None else [MemoryTag(t).value for t in tags]
        await self._call("POST", path, {"tags": names}, self.config.control_timeout_s * 10)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ transport

    async def _weights_call(
        self,
        path: str,
        body: dict[str, Any],
        retries: int | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        timeout_s = timeout_s or self.config.control_timeout_s * 10
        out = await self._call("POST", path, body, timeout_s, retries)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineRequestError(400, f"{path}: {out.get('message')}")
        return out

    def _headers(self) -> dict[str, str]:
        if self.config.api_key:
            return {"Authorization": f"Bearer {self.config.api_key}"}
        return {}

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """One HTTP call with retries; returns parsed JSON (or the text for non-JSON bodies)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.config.control_timeout_s,
            sock_connect=self.config.connect_timeout_s,
        )
        retries = self.config.max_retries if retries is None else retries
        last: str = ""
        for attempt in range(retries + 1):
            if attempt:
                self.retries += 1
                delay = min(self.config.backoff_s * 2 ** (attempt - 1), self.config.backoff_max_s)
                await asyncio.sleep(delay * random.uniform(0.75, 1.25))
            if self.on_request is not None:
                self.on_request(method, path, body)
            try:
                async with self._session.request(
                    method,
                    self.base_url + path,
                    json=body,
                    headers=self._headers(),
                    timeout=timeout,
                ) as resp:
                    text = await resp.text()
                    if resp.status in _RETRY_STATUS or (
                        resp.status == 500 and ROUTER_UPSTREAM_ERROR in text
                    ):
                        last = f"HTTP {resp.status}: {text[:300]}"
                        continue
                    if resp.status >= 400:
                        raise EngineRequestError(resp.status, f"{path}: {_message(text)}")
                    if resp.content_type == "application/json":
                        return await resp.json()
                    return text
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as err:
                last = f"{type(err).__name__}: {err}"
        raise EngineError(f"{self.base_url}{path} failed after {retries + 1} attempt(s): {last}")


def _message(text: str) -> str:
    import json

    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return text[:500]
