"""``megatron-earl serve``: the embedded engine behind SGLang's native HTTP API (a subset).

    megatron-earl serve --model-path HF_DIR|FULL.pt|random --port 30000 [--model-config model.json]
        [--tokenizer-path DIR] [--served-model-name NAME] [--api-key KEY] [--host 127.0.0.1]
        [--max-batch-size 8] [--max-seq-len 1024] [--seed 0] [--weight-dirs DIR[,DIR]]
        [--dist-timeout 300] [--tp-size N] [--pace-decode-ms X] [--decode-threads 1]
        [--compile-decode] [--compile-prefill]

The model (``serve.model``): an HF directory (``config.json`` + safetensors, as SGLang takes it;
its tokenizer when present), a ``torch.save``'d full Megatron state dict
(``geometry.full_state_dict``) or seeded random weights (``random``, ``--seed``), the last two
shaped by ``--model-config`` (a JSON file of ``ModelConfig`` fields; default: the tiny default
config). One process, TP1 (world of one); ``--tp-size N`` serves the model over N processes:
this one (TP rank 0: HTTP, the engine's scheduler) and N-1 followers it starts and stops
(``serve.tp``: same weights as TP1, weight updates on every rank, SGLang's distributed protocol
joined by every TP rank as ``rank_offset + tp_rank``). ``text`` in and out uses the HF tokenizer
(``--tokenizer-path`` or the directory's), else a byte-level stand-in (id < 256 = that byte)
when the vocabulary has >= 256 ids, so stop strings work on a toy model.

Endpoints (shapes of SGLang 0.5.x): ``/generate`` (SGLang's whole request schema, see
``generate_api``: prompts, n samples, min_p, prompt and top log-probs; ``stream`` answers
SGLang's cumulative SSE events, one per token, then ``[DONE]``), ``/health``,
``/health_generate``, ``/get_model_info`` (``/model_info``), ``/get_server_info``
(``/server_info``), ``/v1/models`` (field names of SGLang 0.5.23's answers, ``serve.model``),
``/get_load``, ``/get_weight_version``, ``/flush_cache`` (400 while requests are pending),
``/update_weights_from_tensor`` (both payloads of ``tensor_payload``), SGLang's distributed
protocol over gloo (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``) and ``/update_weights_from_disk`` (an HF safetensors directory
or a full-state file, only below ``--weight-dirs``; see ``serve.weights``),
``/pause_generation``, ``/continue_generation``, ``/abort_request``,
``/release_memory_occupation`` and ``/resume_memory_occupation`` (colocation, ``serve.memory``),
``/get_weights_by_name`` (the first values of a served tensor, to read back what was loaded).
``--pace-decode-ms X`` (measurement only) makes every decode step last at least X ms (the
engine sleeps the rest after the real forward), so a benchmark on a shared CPU sees a fixed
per-token decode time; ``/server_info`` then says ``"paced": true`` and reports the decode steps
and their overruns under ``pacing`` (``embedded.PaceStats``). ``$EARL_SERVE_FAULT_CORRUPT_LOADS=N``
(fault injection, tests only) corrupts the first N weight loads (``FAULT_CORRUPT_LOADS_ENV``).

Bound to 127.0.0.1 by default. Authorization as SGLang's (``serve.auth``): with ``--api-key``
every endpoint but the health probes needs ``Authorization: Bearer KEY``; ``--admin-api-key``
guards the weight/control endpoints instead. Bodies over ``--max-body-mb`` (weight updates:
``--max-weight-body-mb``) get 413. Bad input gets a 4xx with ``{"error": {"message": ...}}``; a
generate request that arrives while a weight update is being applied waits for it to end (as
SGLang holds it) and is served with the new weights.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import json
import logging
import math
import os
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from megatron_earl.compat.http_guard import parse_json, read_body, route_path
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import PauseMode
from megatron_earl.rollout.engine import GenerateRequest, RequestError, SamplingParams
from megatron_earl.rollout.serve import tp as serve_tp
from megatron_earl.rollout.serve.auth import (
    ADMIN_PATHS,
    TENSOR_UPDATE_PATH,
    RequestLimits,
    allowed,
    error_response,
)
from megatron_earl.rollout.serve.generate_api import (
    GENERATE_FIELDS,
    BadRequest,
    GeneratePlan,
    parse_generate,
    parse_weight_version,
)
from megatron_earl.rollout.serve.generate_api import check_fields as _check_fields
from megatron_earl.rollout.serve.memory import MemoryEndpoints
from megatron_earl.rollout.serve.model import (
    ByteCodec,
    ModelPathError,
    ServedModel,
    load_weights,
    model_info_json,
    model_not_found_json,
    models_json,
    resolve_model,
    server_args_json,
    server_info_json,
)
from megatron_earl.rollout.serve.weights import WeightEndpoints

if TYPE_CHECKING:
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine

logger = logging.getLogger("megatron_earl.serve")

FAULT_CORRUPT_LOADS_ENV = "EARL_SERVE_FAULT_CORRUPT_LOADS"
"""Fault injection, for tests of what reads weights back (the relay's check): ``N`` makes the first
N weight loads (updates that set a ``weight_version``: a whole version) add 1.0 to every weight
after loading, answering success as usual. Unset or 0 in any real use."""


def _finished_control(task: asyncio.Task) -> None:
    """Done callback of a shielded control handler (``_answer`` answers every error but an HTTP
    one): an HTTP error raised after its client left is retrieved, so asyncio does not warn."""
    if not task.cancelled():
        task.exception()


class Server(WeightEndpoints, MemoryEndpoints):
    """HTTP front of one embedded engine (its scheduler: TP rank 0)."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        model_path: str,
        api_key: str | None = None,
        *,
        admin_api_key: str | None = None,
        limits: RequestLimits | None = None,
        weight_dirs: tuple[str, ...] = (),
        dist_timeout_s: float = 300.0,
        served: ServedModel | None = None,
        server_args: dict[str, Any] | None = None,
        corrupt_loads: int = 0,
    ):
        self.engine = engine
        self.model_path = model_path
        vocab = engine.model_config.vocab_size
        self.served = served or ServedModel(
            engine.model_config,
            model_path,
            "random" if model_path == "random" else "full_state",
            None,
            ByteCodec() if vocab >= 256 else None,
            served_model_name=model_path,
        )
        """What is served (``serve.model``): its paths, tokenizer, eos ids, identity."""
        self.server_args = server_args or {}
        """Launch arguments under SGLang's names (``serve.model.server_args_json``)."""
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.limits = limits or RequestLimits()
        self.weight_dirs = tuple(Path(d).resolve() for d in weight_dirs)
        """Directories ``update_weights_from_disk`` may read (symlinks resolved; none: off)."""
        self.dist_timeout_s = dist_timeout_s
        """How long a weight-update group waits for its other ranks to join."""
        self.updating = False
        self._update_lock = asyncio.Lock()
        self._update_done = asyncio.Event()
        """Set when no weight update is running (generate requests wait for it)."""
        self._update_done.set()
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, "serve-tokenizer")
        """Parses ``/generate`` bodies (tokenizes their text), one at a time, off the loop."""
        self._tensor_update_slot = asyncio.Semaphore(1)
        """Held by a ``/update_weights_from_tensor`` request for its whole handling (its body
        peaks at ~2x its size in memory), so that concurrent updates do not add up."""
        self._control_tasks: set[asyncio.Task] = set()
        """Control handlers running shielded from their client's disconnect (``_middleware``)."""
        self.corrupt_loads = corrupt_loads
        """Fault injection (``$EARL_SERVE_FAULT_CORRUPT_LOADS``): this many more weight loads
        are corrupted after loading (``_update``)."""
        self._init_weight_endpoints()

    def detokenize(self, ids: Any, skip_special_tokens: bool = True) -> str:
        codec = self.served.codec
        return codec.decode(ids, skip_special_tokens) if codec is not None else ""

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._middleware],
            client_max_size=max(self.limits.max_body_bytes, self.limits.max_weight_body_bytes),
        )
        routes = [
            (("POST", "PUT"), "/generate", self.generate),
            (("GET",), "/health", self.health),
            (("GET",), "/health_generate", self.health_generate),
            (("GET",), "/get_model_info", self.model_info),
            (("GET",), "/model_info", self.model_info),
            (("GET",), "/get_server_info", self.server_info),
            (("GET",), "/server_info", self.server_info),
            (("GET",), "/v1/models", self.models),
            (("GET",), "/v1/models/{model:.+}", self.model_card),
            (("GET",), "/get_load", self.load),
            (("GET",), "/get_weight_version", self.weight_version),
            (("GET", "POST"), "/flush_cache", self.flush_cache),
            (("POST",), "/update_weights_from_tensor", self.update_from_tensor),
            (("POST",), "/update_weights_from_disk", self.update_weights_from_disk),
            (("POST",), "/init_weights_update_group", self.init_weights_update_group),
            (("POST",), "/update_weights_from_distributed", self.update_weights_from_distributed),
            (("POST",), "/destroy_weights_update_group", self.destroy_weights_update_group),
            (("POST",), "/begin_weight_update", self.begin_weight_update),
            (("POST",), "/end_weight_update", self.end_weight_update),
            (("GET", "POST"), "/get_weights_by_name", self.get_weights_by_name),
            (("POST",), "/pause_generation", self.pause),
            (("POST",), "/continue_generation", self.resume),
            (("POST",), "/abort_request", self.abort),
            (("GET", "POST"), "/release_memory_occupation", self.release_memory_occupation),
            (("GET", "POST"), "/resume_memory_occupation", self.resume_memory_occupation),
        ]
        for methods, path, handler in routes:  # SGLang's methods per route, never "*"
            for method in methods:
                app.router.add_route(method, path, handler)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Awaitable]):
        header, route = request.headers.get("Authorization"), route_path(request)
        if not allowed(route, header, self.api_key, self.admin_api_key):
            kind = "admin key" if route in ADMIN_PATHS and self.admin_api_key else "api key"
            return error_response(401, f"{request.path} needs 'Authorization: Bearer <{kind}>'")
        limit = self.limits.for_path(request.path)
        if request.content_length is not None and request.content_length > limit:
            return error_response(
                413,
                f"request body of {request.content_length} bytes exceeds the limit of "
                f"{limit} bytes for {request.path}",
            )
        if request.path == "/generate":  # a gone client cancels it: its sequences are aborted
            return await self._answer(request, handler, limit)
        # Every other handler runs to completion whatever the client does: a control or weight
        # operation cancelled between its engine step and its bookkeeping (released tags, the
        # weight version, a group) would leave the engine inconsistent.
        task = asyncio.ensure_future(self._answer(request, handler, limit))
        self._control_tasks.add(task)
        task.add_done_callback(self._control_tasks.discard)
        task.add_done_callback(_finished_control)
        return await asyncio.shield(task)

    async def _answer(
        self, request: web.Request, handler: Callable[..., Awaitable], limit: int
    ) -> web.StreamResponse:
        try:
            if request.path != TENSOR_UPDATE_PATH:
                return await handler(request)
            async with self._tensor_update_slot:  # one tensor update (its body) at a time
                return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return error_response(
                413, f"request body exceeds the limit of {limit} bytes for {request.path}"
            )
        except (BadRequest, RequestError) as err:
            return error_response(400, str(err))
        except RecursionError:  # a value nested just under the parser's limit, then walked
            return error_response(400, f"{request.path}: the request is nested too deeply")
        except web.HTTPException:
            raise
        except Exception as err:  # a bug answered for this request only; the server goes on
            if isinstance(err, ConnectionError) and _client_gone(request):
                # A write after the client left (its sequences are cancelled already). Nobody
                # reads this answer: aiohttp's write of it fails quietly (raising would make
                # aiohttp log the error as a server bug).
                return web.Response(status=499, reason="Client Closed Request")
            logger.exception("%s failed", request.path)
            return error_response(500, f"{request.path} failed: {type(err).__name__}: {err}")

    async def _json(self, request: web.Request, allowed: frozenset[str], what: str) -> dict:
        if not request.can_read_body:
            return _check_fields({}, allowed, what)
        timeout, limit = self.limits.body_timeout(request.path), self.limits.for_path(request.path)
        try:
            in_place = request.path == TENSOR_UPDATE_PATH  # one at a time: _tensor_update_slot
            raw = await asyncio.wait_for(read_body(request, limit, in_place), timeout)
        except TimeoutError:
            raise web.HTTPRequestTimeout(
                text=f"the request body of {request.path} was not received within {timeout:g}s"
            ) from None
        try:  # a weight payload of up to --max-weight-body-mb: decoded off the event loop
            body = (
                await asyncio.to_thread(parse_json, raw, what)
                if len(raw) > 1 << 20
                else parse_json(raw, what)
            )
        except ValueError as err:
            raise BadRequest(str(err)) from None
        return _check_fields(body, allowed, what)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's ``/generate`` (``generate_api``: the schema, the response shape)."""
        body = await self._json(request, GENERATE_FIELDS, "the /generate request")
        codec, max_seq = self.served.codec, self.engine.config.max_seq_len
        parse = functools.partial(
            parse_generate,
            body,
            max_seq_len=max_seq,
            tokenize=codec.encode if codec is not None else None,
            eos_token_ids=self.served.eos_token_ids,
        )  # tokenizing long text: in one thread, off the event loop (/health keeps answering)
        plan = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, parse)
        while self.updating:  # after the parse: an update may have begun meanwhile. SGLang
            await self._update_done.wait()  # holds the request (its model-update lock)
        if (released := self.released_response()) is not None:
            return released
        for req in plan.requests:
            self.engine.validate(req)
        queued = self.engine.num_requests
        if queued + len(plan.requests) > self.limits.max_queued_requests:
            return error_response(
                429,
                f"the engine holds {queued} requests; {len(plan.requests)} more would exceed "
                f"--max-queued-requests {self.limits.max_queued_requests}: retry later",
                headers={"Retry-After": "1"},
            )
        if plan.stream:
            return await self._stream(request, plan)
        tasks = [asyncio.ensure_future(self.engine.generate(r)) for r in plan.requests]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # one sequence failed (or the client left): its siblings are aborted
            for task in tasks:
                task.cancel()
        return web.json_response(plan.response(results, self.detokenize))

    async def _stream(self, request: web.Request, plan: GeneratePlan) -> web.StreamResponse:
        """Server-sent events as SGLang streams them (its default, cumulative form): one
        ``data: {...}`` event per sampled token with the text and ids so far (``finish_reason``
        null), the last one the full result; ``index`` names the sequence of a list answer;
        then ``data: [DONE]``. A failed sequence ends the stream with an ``error`` event."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events: asyncio.Queue = asyncio.Queue()
        so_far: list[tuple[list[int], list[float]]] = [([], []) for _ in plan.requests]

        async def run(i: int, req: GenerateRequest) -> None:
            def progress(rid: str, token: int, logprob: float) -> None:
                events.put_nowait(("token", i, rid, token, logprob))

            try:
                events.put_nowait(("done", i, await self.engine.generate(req, progress)))
            except Exception as err:  # the stream ends with an error event
                events.put_nowait(("error", i, err))

        tasks = [asyncio.ensure_future(run(i, r)) for i, r in enumerate(plan.requests)]
        remaining = len(tasks)
        try:  # a client gone: the requests left are cancelled (aborted in the engine)
            while remaining:
                kind, i, *rest = await events.get()
                if kind == "token":
                    ids, logprobs = so_far[i]
                    ids.append(rest[1])
                    logprobs.append(rest[2])
                    version = self.engine.weight_version
                    item = plan.partial_json(i, rest[0], ids, logprobs, version, self.detokenize)
                elif kind == "done":
                    item = plan.result_json(i, rest[0], self.detokenize)
                    remaining -= 1
                else:
                    item = {"error": {"message": f"{rest[0]}", "code": 500}}
                    remaining = 0
                if plan.batched:
                    item["index"] = i
                await resp.write(b"data: " + json.dumps(item).encode() + b"\n\n")
        finally:
            for task in tasks:
                task.cancel()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ health and info

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if await self.engine.health() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's: generate one greedy token from ``input_ids=[0]`` (rid ``HEALTH_CHECK_*``);
        200 when it comes within ``SGLANG_HEALTH_CHECK_TIMEOUT`` s (default 20), else 503. While
        generation is paused or weights load, 200 without a probe (SGLang's probe would wait
        for the continue and a router would drop the engine during every weight push)."""
        if not await self.engine.health():
            return web.Response(status=503)
        if self.engine.paused or self.updating or self.engine.released:
            return web.Response(status=200)
        probe = GenerateRequest(
            (0,),
            SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        )
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
        try:
            await asyncio.wait_for(self.engine.generate(probe), timeout=timeout)
        except Exception:
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/model_info`` fields (``serve.model.model_info_json``)."""
        return web.json_response(model_info_json(self.served, self.engine.weight_version))

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/server_info``: server args + start info + internal states."""
        config = self.engine.config
        return web.json_response(
            server_info_json(
                self.server_args,
                self.served,
                max_batch_size=config.max_batch_size,
                max_seq_len=config.max_seq_len,
                paused=self.engine.paused,
            )
            | self.memory_info()
            | {"paced": self.engine.pace_stats.pace_s > 0}
            | {"pacing": self.engine.pace_stats.to_dict()}
        )

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's model list as SGLang answers it (the one served model)."""
        return web.json_response(models_json(self.served, self.engine.config.max_seq_len))

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.served.served_model_name:
            return web.json_response(model_not_found_json(name), status=404)
        cards = models_json(self.served, self.engine.config.max_seq_len)["data"]
        return web.json_response(cards[0])

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"num_reqs": self.engine.num_requests})

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.weight_version)})

    # ------------------------------------------------------------------ control

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.num_requests:
            return web.Response(status=400, text="Cache not flushed: requests are pending.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def pause(self, request: web.Request) -> web.Response:
        body = await self._json(request, frozenset({"rid", "mode"}), "pause_generation")
        try:
            mode = PauseMode(body.get("mode", PauseMode.ABORT))
        except ValueError as err:
            raise BadRequest(f"pause_generation: {err}") from None
        await self.engine.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        fields = frozenset({"rid", "torch_empty_cache"})
        await self._json(request, fields, "continue_generation")
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        fields = frozenset({"rid", "abort_all", "abort_message"})
        body = await self._json(request, fields, "abort_request")
        if body.get("abort_all"):
            await self.engine.abort_all(body.get("abort_message") or "aborted by abort_request")
        elif body.get("rid"):
            await self.engine.abort(str(body["rid"]))
        else:
            raise BadRequest("abort_request needs rid or abort_all=true")
        return web.Response(status=200)

    async def _update(
        self,
        body: dict[str, Any],
        apply: Callable[[dict], None],
        before: Callable[[], Awaitable[None]] | None = None,
    ) -> web.Response:
        """Apply a weight update to a copy of the full state, check it (``_check_update``), load
        it. ``before`` runs first inside the update window (receiving a broadcast bucket)."""
        version = self.engine.weight_version
        if body.get("weight_version") is not None:
            version = parse_weight_version(body["weight_version"])
        async with self._update_lock:
            self.check_weights_resident("the weight update")
            self.updating = True
            self._update_done.clear()
            try:
                if before is not None:
                    await before()
                if body.get("abort_all_requests"):
                    await self.engine.abort_all("aborted for a weight update")
                full = await self.engine.state_dict()
                await asyncio.to_thread(_apply_checked, full, apply)  # off the event loop
                if self.corrupt_loads and body.get("weight_version") is not None:
                    self.corrupt_loads -= 1  # fault injection: a load that silently goes wrong
                    for tensor in full.values():
                        if tensor.is_floating_point():
                            tensor += 1.0
                    logger.warning(
                        "FAULT INJECTION (%s): weight version %s loaded with every weight + 1.0",
                        FAULT_CORRUPT_LOADS_ENV,
                        version,
                    )
                await self.engine.load_state_dict(full, version)
            finally:
                self.updating = False
                self._update_done.set()
        return web.json_response({"success": True, "message": f"weight version {version}"})


def _client_gone(request: web.Request) -> bool:
    """The client's connection is closed or closing (a stream's next write fails when it comes
    before ``handler_cancellation`` cancels the handler)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _apply_checked(full: dict[str, torch.Tensor], apply: Callable[[dict], None]) -> None:
    """``apply`` the update to ``full`` (a copy of the served state), then ``_check_update``."""
    shapes = {name: (t.shape, t.dtype) for name, t in full.items()}
    try:
        apply(full)
    except (KeyError, ValueError) as err:
        raise BadRequest(f"weight update rejected: {err}") from None
    _check_update(full, shapes)


def _check_update(full: dict[str, torch.Tensor], before: dict[str, tuple]) -> None:
    """Refuse, before anything is loaded, tensors that would break the served model: unknown
    names, other shapes, non-finite values (the served weights stay as they were)."""
    unknown = sorted(set(full) - set(before))
    if unknown:
        raise BadRequest(f"weight update rejected: unknown parameters {unknown[:4]}")
    for name, tensor in full.items():
        shape, _ = before[name]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise BadRequest(
                f"weight update rejected: {name} has shape {got}, the model's is {tuple(shape)}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise BadRequest(f"weight update rejected: {name} has non-finite values (NaN/inf)")


def resolve_served(args: argparse.Namespace) -> ServedModel:
    """``--model-path`` / ``--model-config`` / ``--tokenizer-path`` -> what is served
    (``serve.model.resolve_model``; ``ModelPathError`` names what cannot be served)."""
    return resolve_model(
        args.checkpoint, args.model_config, args.tokenizer_path, args.served_model_name
    )


def build_engine(
    args: argparse.Namespace, served: ServedModel | None = None
) -> tuple[EmbeddedEngine, ModelConfig]:
    """Build the model (HF directory, full-state file or seeded weights, see ``serve.model``) and
    the engine: a world of one at TP1, with ``--tp-size N`` every rank of the world of N
    (``serve.tp``: the model is built whole, then in tp=N from its full state)."""
    # megatron-core (~1.5 s of imports) only once the arguments and the model path are checked
    from megatron_earl import runtime
    from megatron_earl.models.gpt import build_model
    from megatron_earl.models.impl import pin_transformer_impl
    from megatron_earl.parallel.layout import ParallelLayout
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    served = served or resolve_served(args)
    if served.model_config.is_moe:
        raise ValueError(
            f"megatron-earl serve does not serve mixture-of-experts models yet (num_experts="
            f"{served.model_config.num_experts}): their rollouts run on the embedded engine of "
            "megatron-earl train (rollout.engine: embedded; docs/moe.md)"
        )
    runtime.initialize()
    model_config = pin_transformer_impl(served.model_config, embedded_engine=True)
    model_config.validate_for_parallel(args.tp_size)
    initialize_layout(ParallelLayout(dp=args.tp_size))  # whole on every rank, as at TP1
    runtime.seed(args.seed)
    chunks = build_model(model_config)
    load_weights(chunks, served)
    chunks = serve_tp.to_tp_layout(chunks, model_config, args.tp_size, args.seed)
    config = EmbeddedEngineConfig(
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        pace_decode_s=args.pace_decode_ms / 1e3,
        decode_threads=args.decode_threads,
        compile_decode=args.compile_decode,
        compile_prefill=args.compile_prefill,
    )
    return EmbeddedEngine(
        chunks, model_config, config, weight_version=args.weight_version
    ), model_config


async def serve(args: argparse.Namespace) -> None:
    served = resolve_served(args)
    engine, _ = build_engine(args, served)
    limits = RequestLimits(
        args.max_body_mb << 20,
        args.max_weight_body_mb << 20,
        body_timeout_s=args.body_timeout,
        max_queued_requests=args.max_queued_requests,
    )
    server = Server(
        engine,
        served.model_path,
        args.api_key,
        admin_api_key=args.admin_api_key,
        limits=limits,
        weight_dirs=tuple(d for arg in args.weight_dirs for d in arg.split(",") if d),
        dist_timeout_s=args.dist_timeout,
        served=served,
        server_args=server_args_json(args, served),
        corrupt_loads=args.corrupt_loads,
    )
    engine.detokenize = server.detokenize if served.codec is not None else None
    await engine.start()
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests in the engine (they would otherwise run to completion for nobody).
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    pace = args.pace_decode_ms
    notes = f" (PACED: every decode step >= {pace:g} ms)" if pace else ""
    if args.corrupt_loads:
        notes += f" (FAULT INJECTION: the next {args.corrupt_loads} weight loads are corrupted)"
    print(f"megatron-earl serve: listening on http://{args.host}:{args.port}{notes}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await engine.shutdown()
    server._tokenizer_thread.shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-earl serve", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--api-key", default=None, help="required on every endpoint but health probes when set"
    )
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="required (instead of --api-key) on the admin endpoints: weight updates, flush, "
        "pause/continue, abort",
    )
    p.add_argument("--max-body-mb", type=int, default=16, help="request body limit (MiB)")
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds to send a request body (408)"
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=4096,
        help="sequences waiting or running at most; more get 429 with Retry-After",
    )
    p.add_argument(
        "--max-weight-body-mb",
        type=int,
        default=RequestLimits.max_weight_body_bytes >> 20,
        help="weight-update body limit (MiB); an update peaks at ~2x its body in memory",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="JSON file of ModelConfig fields (with a full-state file or 'random'; an HF "
        "directory's config.json defines its model)",
    )
    p.add_argument(
        "--model-path",
        "--checkpoint",
        dest="checkpoint",
        default=None,
        metavar="PATH",
        help="HF directory (config.json + safetensors, tokenizer when present), torch.save'd "
        "full Megatron state dict, or 'random' (seeded random weights; the default)",
    )
    p.add_argument(
        "--tokenizer-path",
        default=None,
        help="HF tokenizer directory (default: the HF model directory's own, if it has one; "
        "else a byte-level stand-in)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name in /v1/models and model info (default: --model-path)",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel processes serving the model (default 1; N > 1 starts N-1 "
        "followers, see serve_tp)",
    )
    # SGLang launch flags the launcher passes; accepted for command compatibility.
    p.add_argument("--skip-server-warmup", action="store_true", help="accepted, no effect")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted, no effect")
    p.add_argument("--enable-memory-saver", action="store_true", help="accepted, no effect")
    p.add_argument(
        "--seed",
        "--random-seed",
        type=int,
        default=0,
        help="weights (with 'random'), sampling",
    )
    p.add_argument(
        "--max-batch-size",
        "--max-running-requests",
        type=int,
        default=8,
        help="sequences decoded together (KV rows)",
    )
    p.add_argument(
        "--max-seq-len",
        "--context-length",
        type=int,
        default=1024,
        help="prompt + output tokens per sequence",
    )
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument(
        "--weight-dirs",
        action="append",
        default=[],
        metavar="DIR[,DIR]",
        help="directories update_weights_from_disk may read (repeatable; default: none, "
        "disk updates answer 403)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        help="seconds a weight-update group waits for its other ranks (default 300)",
    )
    p.add_argument(
        "--pace-decode-ms",
        type=float,
        default=0.0,
        help="measurement only: every decode step lasts at least this many ms (sleeps the rest "
        "after the real forward; reported as paced in /server_info); default 0: unpaced",
    )
    p.add_argument(
        "--decode-threads",
        type=int,
        default=1,
        help="torch threads of a decode step (default 1; 0: as many as a prefill step)",
    )
    p.add_argument(
        "--compile-decode",
        "--enable-torch-compile",
        action="store_true",
        help="torch.compile the decode step (tp 1; compiled at the engine's first step)",
    )
    p.add_argument(
        "--compile-prefill",
        action="store_true",
        help="torch.compile prefill steps of small attention (tp 1; compiled at the engine's "
        "first step; longer prefills run eagerly)",
    )
    args = p.parse_args(argv)
    if args.tp_size < 1:
        p.error(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.decode_threads < 0:
        p.error(
            f"--decode-threads must be >= 0 (0: the prefill's threads), got {args.decode_threads}"
        )
    for flag, on in (("--compile-decode", args.compile_decode),
                     ("--compile-prefill", args.compile_prefill)):  # fmt: skip
        if on and args.tp_size > 1:
            p.error(
                f"{flag} needs --tp-size 1 (the compiled step holds no TP collectives), "
                f"got --tp-size {args.tp_size}"
            )
    raw = os.environ.get(FAULT_CORRUPT_LOADS_ENV, "0")
    args.corrupt_loads = int(raw) if raw.isdigit() else -1
    if args.corrupt_loads < 0:
        p.error(f"${FAULT_CORRUPT_LOADS_ENV} must be an integer >= 0 (0: off), got {raw!r}")
    if not (math.isfinite(args.pace_decode_ms) and args.pace_decode_ms >= 0):
        p.error(
            f"--pace-decode-ms must be a finite number >= 0 (0: unpaced), got {args.pace_decode_ms}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        with serve_tp.followers(args.tp_size, sys.argv[1:] if argv is None else argv):
            asyncio.run(serve(args))
    except ModelPathError as err:
        print(f"megatron-earl serve: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    # Run the imported module, not this ``__main__`` copy: ``serve.weights`` raises this
    # module's ``BadRequest``, which the middleware of a ``__main__`` copy would not catch.
    from megatron_earl.compat.processes import skip_exit_gc
    from megatron_earl.rollout.serve.server import main as imported_main

    skip_exit_gc()
    sys.exit(imported_main())
