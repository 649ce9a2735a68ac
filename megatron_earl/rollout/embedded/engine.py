"""The embedded engine: the Megatron model itself generating in the rollout layout.

    engine = EmbeddedEngine(chunks, model_config, EmbeddedEngineConfig(max_batch_size=8))
    result = run_engine(engine, driver)      # every rank of the TP group calls it

Why not megatron-core's own engines (0.16.1): the dynamic engine needs flash-attn kernels with a
block table (``flash_decode_and_prefill``), Triton KV-append kernels and CUDA unified memory;
the static engine batches statically (one shared offset, all requests start together, prompts
padded to the shortest) and drives generation through a tokenizer. Neither runs on CPU with small
patches, and the static one cannot add a request to a running batch. This engine is compact: a
scheduler loop over ``BatchedForward`` (the model's own Megatron modules run on packed tokens with
a row KV cache, ``batched_forward.py`` and ``kv_cache.py``). Each loop iteration is at most two
forwards: one prefill of every waiting request that fits (free rows, ``max_prefill_tokens``;
the rest wait, FIFO) and one decode of every running request; sampling is one vectorised draw
over the step's rows (``sampling.py``). New requests join at the next iteration (continuous
batching at request granularity); a finished request's row is refilled by the last row.

Ranks: with tp > 1 the TP rank 0 of each TP group is the scheduler (it runs asyncio, owns the
requests and samples); every step is a small ``Step`` broadcast over the TP group and executed by
all ranks of the group (the TP-parallel forward and the last-token logits all-gather). Peers run
``follow()``. Every DP replica of the rollout layout is an independent engine; pp and cp must be 1.
Weights: ``load_state_dict`` (server / tests) or an external reshard into ``model_chunks`` (every
rank, while the engine is not serving) followed by ``mark_weights_updated(version)``;
``state_dict`` gathers the full tensors back. ``call(fn)`` runs ``fn(engine)`` on every TP rank
between steps (a server's work that needs every rank, e.g. joining a weight-update group). An idle
scheduler sends a no-op step every ``PING_INTERVAL_S`` so that peers waiting for the next step
never reach their group's timeout (Megatron's groups: 30 minutes).
Colocation (``memory_occupation.EngineMemory``): ``release_memory_occupation(tags)`` frees the KV
cache and/or the weights (kept on the host) of an idle engine on every rank of the TP group;
requests wait until ``resume_memory_occupation`` has brought every released tag back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from megatron_earl import runtime
from megatron_earl.compat import event_loop
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import MemoryTag, TransformerImpl
from megatron_earl.models.impl import machine_transformer_impl
from megatron_earl.parallel.groups import host_group
from megatron_earl.rollout.embedded.batched_forward import BatchedForward
from megatron_earl.rollout.embedded.kv_cache import RowTable
from megatron_earl.rollout.embedded.memory_occupation import EngineMemory, WeightBackup
from megatron_earl.rollout.embedded.results import EngineRequest, StepResults, prompt_start
from megatron_earl.rollout.embedded.sampling import host_to
from megatron_earl.rollout.embedded.step import Batch, Step
from megatron_earl.rollout.engine import (
    EngineError,
    FinishReason,
    FinishType,
    GenerateRequest,
    GenerateResult,
    RequestError,
)

T = TypeVar("T")

MAX_FORWARD_FAILURES = 3
"""Forwards failing in a row after which the engine is failed (a request-level cause fails one
step; a persistent one, e.g. a device fault, should not fail every request forever)."""


PING_INTERVAL_S = 60.0
"""Idle seconds after which the scheduler of a TP group > 1 sends its peers a no-op step."""


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Capacity and sampling stream of the embedded engine."""

    max_batch_size: int = 8
    """Requests decoded together at most (KV-cache rows; more requests wait, none is refused);
    fewer when ``kv_cache_bytes`` holds fewer rows."""
    kv_cache_bytes: float | None = None
    """Memory budget of the KV cache on this rank: the engine allocates the whole rows of
    ``max_seq_len`` tokens it holds, at most ``max_batch_size`` (``config.embedded.
    kv_cache_rows``; an engine that holds no row is refused with the budget and a row's bytes).
    None: ``max_batch_size`` rows. The RL loop derives it from the device memory
    (``rollout.embedded.kv_memory_fraction``) or ``rollout.embedded.kv_cache_mb``."""
    max_seq_len: int = 1024
    """Context limit: prompt + generated tokens of one request (KV-cache length)."""
    max_prefills_per_step: int = 64
    """Requests admitted (prefilled together in one forward) between two decode steps at most."""
    max_prefill_tokens: int = 8192
    """Padded tokens of one prefill forward at most (sequences x the longest uncached context;
    a longer context is prefilled alone): bounds the prefill's queries and activations (the
    attention's keys also span a reused session's cached prefix, up to ``max_seq_len``)."""
    seed: int = 0
    """Seed of the sampling stream of requests that bring no seed of their own."""
    pace_decode_s: float = 0.0
    """Measurement only (``megatron-earl serve --pace-decode-ms``): every decode step takes at
    least this wall time -- the engine sleeps the rest after the real forward, so per-token
    decode time is fixed whatever the CPU contention (``PaceStats`` counts the steps whose
    forward was slower). 0: unpaced. Prefills are not paced. Tokens are unchanged."""

    decode_threads: int = 1
    """``torch`` intra-op threads of a decode step (0: as many as a prefill step, which uses
    the process's setting at construction). One by default: a decode step of a small model is
    ~80 small ops, and each parallel region costs a wake-up of the other threads that the
    arithmetic does not repay (docs/engines.md, "Threads")."""

    compile_decode: bool = False
    """``torch.compile`` the decode step (``BatchedForward``; tp 1 only): fewer, fused kernels
    per step, paid for by a compilation at the engine's first step (docs/engines.md)."""

    compile_prefill: bool = False
    """``torch.compile`` the prefill step up to ``PREFILL_COMPILE_MAX_SCORES`` attention scores
    (``BatchedForward``; tp 1 only; a longer prefill runs eagerly), compiled with the decode
    step's graphs at the engine's first step (docs/engines.md)."""

    record_routes: bool = False
    """Keep every cached position's routed experts (a mixture-of-experts model; routing replay):
    requests may then ask for them (``return_routed_experts``). Costs an int16 per layer and
    top-k slot per cached position, one gather over TP per step, and the last layer's MLP on
    every new token of a prefill."""

    step_thread: bool = True
    """Run each step in a worker thread, so the event loop stays responsive while a step
    computes: the HTTP server of ``serve`` answers, and the agent loops' env/reward timeouts see
    their calls complete, during a long prefill or the first compiled decode step. False: on the
    event loop's own thread, no per-step thread hand-off; the loop waits during each step and
    yields once per scheduler iteration (a task resumes one await per step). For measurement
    drivers (``bench engine``, where a second OpenMP team in the process would slow the HF
    side); docs/engines.md, "Scheduling"."""

    def __post_init__(self) -> None:
        if self.decode_threads < 0:
            raise ValueError(
                f"decode_threads must be >= 0 (0: the prefill's threads), got {self.decode_threads}"
            )
        names = ("max_batch_size", "max_seq_len", "max_prefills_per_step", "max_prefill_tokens")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.pace_decode_s) and self.pace_decode_s >= 0):
            raise ValueError(
                f"pace_decode_s must be a finite number of seconds >= 0 (0: unpaced), "
                f"got {self.pace_decode_s}"
            )


@dataclass
class PaceStats:
    """Decode-step timing of an engine (kept paced or not; the pace is ``pace_s``)."""

    pace_s: float = 0.0
    """The configured decode pace (0: unpaced)."""
    decode_steps: int = 0
    """Decode steps run."""
    overruns: int = 0
    """Paced decode steps whose real forward alone took longer than the pace (not slept)."""
    min_step_s: float = math.inf
    """Shortest decode step (forward + pacing sleep), seconds."""
    max_forward_s: float = 0.0
    """Longest real decode forward, seconds."""
    forward_s: float = 0.0
    """Real decode forwards, seconds in total."""
    sleep_s: float = 0.0
    """Pacing sleeps, seconds in total."""
    prefill_steps: int = 0
    """Prefill forwards run (never paced)."""
    prefill_s: float = 0.0
    """Prefill forwards, seconds in total (the simulator's ``prefill_s`` is their mean)."""

    def record_prefill(self, seconds: float) -> None:
        self.prefill_steps += 1
        self.prefill_s += seconds

    def record(self, forward_s: float, step_s: float) -> None:
        self.decode_steps += 1
        self.forward_s += forward_s
        self.max_forward_s = max(self.max_forward_s, forward_s)
        self.min_step_s = min(self.min_step_s, step_s)
        if self.pace_s and forward_s > self.pace_s:
            self.overruns += 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, times in ms: what ``/server_info`` reports under ``pacing``."""
        n = self.decode_steps
        return {
            "paced": self.pace_s > 0,
            "pace_decode_ms": self.pace_s * 1e3,
            "decode_steps": n,
            "overruns": self.overruns,
            "min_step_ms": self.min_step_s * 1e3 if n else None,
            "mean_forward_ms": self.forward_s / n * 1e3 if n else None,
            "max_forward_ms": self.max_forward_s * 1e3,
            "sleep_ms": self.sleep_s * 1e3,
            "prefill_steps": self.prefill_steps,
            "mean_prefill_ms": self.prefill_s / self.prefill_steps * 1e3
            if self.prefill_steps
            else None,
        }


class EmbeddedEngine(StepResults, EngineMemory):
    """Engine over this rank's model chunk; see the module docstring for the rank roles."""

    def __init__(
        self,
        model_chunks: Sequence[nn.Module],
        model_config: ModelConfig,
        config: EmbeddedEngineConfig | None = None,
        *,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        weight_version: int = 0,
    ) -> None:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        if len(model_chunks) != 1 or pp != 1 or cp != 1:
            raise ValueError(
                f"the embedded engine needs one model chunk with pp == 1 and cp == 1, got "
                f"{len(model_chunks)} chunks, pp={pp}, cp={cp}; use a rollout layout of tp/dp only"
            )
        if machine_transformer_impl(model_config) == TransformerImpl.TRANSFORMER_ENGINE:
            raise ValueError(
                "the embedded engine needs the local implementation (its slot KV cache needs an "
                "explicit attention mask, which Megatron's TE attention drops), but "
                f"model.transformer_impl={model_config.transformer_impl!r} builds Transformer "
                "Engine layers here; set it to local, or pin auto with "
                "models.impl.pin_transformer_impl(model, embedded_engine=True) before build_model"
            )
        self.model_chunks = list(model_chunks)
        self.model = self.model_chunks[0]
        self.model.eval()
        self.model_config = model_config
        self.config = config or EmbeddedEngineConfig()
        self.detokenize = detokenize
        self._version = weight_version
        self._forward = BatchedForward(
            self.model,
            self.config.max_batch_size,
            self.config.max_seq_len,
            kv_cache_bytes=self.config.kv_cache_bytes,
            compile_decode=self.config.compile_decode,
            compile_prefill=self.config.compile_prefill,
            record_routes=self.config.record_routes,
        )
        prefill_threads = torch.get_num_threads()
        self._threads = (prefill_threads, self.config.decode_threads or prefill_threads)
        """Intra-op threads of a (prefill, decode) step, set in the thread that runs it (the
        setting is per thread: the step thread starts with OpenMP's default, all cores)."""
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._tp = parallel_state.get_tensor_model_parallel_world_size()
        self._src = parallel_state.get_tensor_model_parallel_src_rank()
        self.is_scheduler = parallel_state.get_tensor_model_parallel_rank() == 0
        # Scheduler state (TP rank 0 only).
        self._waiting: deque[EngineRequest] = deque()
        self._table: RowTable[EngineRequest] = RowTable(self.num_rows)
        """Running requests by cache row, their cached lengths, parked sessions."""
        self._paused = False
        self._released: set[MemoryTag] = set()
        """Memory tags released (every rank; generation waits while any is)."""
        self._weight_backup: WeightBackup | None = None
        """This rank's released weights (host copies), while ``weights`` is released."""
        self._failed: BaseException | None = None
        self._forward_failures = 0
        self.pace_stats = PaceStats(self.config.pace_decode_s)
        """Decode-step timing (scheduler rank); the pacing's evidence."""
        self._ids = itertools.count()
        self._stream = random.Random(self.config.seed)
        self._wake: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ Engine protocol

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def tp_size(self) -> int:
        """Ranks of this engine's TP group (every one executes each step)."""
        return self._tp

    @property
    def num_requests(self) -> int:
        """Requests waiting or running (the engine's load)."""
        return len(self._waiting) + len(self._table.items)

    @property
    def num_rows(self) -> int:
        """KV-cache rows: requests decoded at once at most (``max_batch_size``, or fewer when
        ``kv_cache_bytes`` holds fewer); the rest wait."""
        return self._forward.cache.max_batch_size

    @property
    def num_running(self) -> int:
        """Requests holding a KV-cache row (at most ``num_rows``; the rest wait)."""
        return len(self._table.items)

    async def generate(
        self,
        request: GenerateRequest,
        progress: Callable[[str, int, float], None] | None = None,
    ) -> GenerateResult:
        """Queue a request and wait for its result (scheduler rank, inside ``run_engine``);
        ``progress(rid, token, logprob)`` is called in the event loop as each token but the
        last is sampled (streaming; an exception from it fails the request)."""
        self._check_running()
        self.validate(request)
        seed = request.sampling.seed
        gen = self._stream if seed is None else random.Random(seed)
        rid = request.rid or f"emb-{next(self._ids)}"
        entry = EngineRequest(request, asyncio.get_running_loop().create_future(), gen, rid)
        entry.top_k, entry.progress = request.top_logprobs_num, progress
        entry.extras = bool(entry.top_k or progress)
        self._waiting.append(entry)
        self._wake.set()
        try:
            return await entry.future
        except asyncio.CancelledError:
            entry.abort_message = "caller cancelled"
            self._wake.set()
            raise

    async def abort(self, rid: str) -> None:
        for entry in itertools.chain(self._waiting, self._table.items):
            if entry.rid == rid:
                entry.abort_message = "aborted by request"
        self._wake.set()

    async def abort_all(self, message: str = "aborted") -> int:
        entries = list(itertools.chain(self._waiting, self._table.items))
        for entry in entries:
            entry.abort_message = message
        self._wake.set()
        return len(entries)

    async def health(self) -> bool:
        return self._task is not None and not self._task.done() and self._failed is None

    def validate(self, request: GenerateRequest) -> None:
        """Raise ``RequestError`` when the request cannot be served as given."""
        vocab, limit = self.model_config.vocab_size, self.config.max_seq_len
        n = len(request.input_ids)
        if n == 0:
            raise RequestError("input_ids is empty; give at least one token id")
        bad = [t for t in request.input_ids if not 0 <= int(t) < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        total = n + request.sampling.max_new_tokens
        if total > limit:
            raise RequestError(
                f"prompt ({n} tokens) + max_new_tokens ({request.sampling.max_new_tokens}) = "
                f"{total} exceeds the context limit max_seq_len={limit}"
            )
        if request.sampling.stop and self.detokenize is None:
            raise RequestError("stop strings need a detokenizer; this engine has none")
        start, top = request.logprob_start_len, request.top_logprobs_num
        if not (_is_int(start) and -1 <= start <= n):
            raise RequestError(
                f"logprob_start_len must be -1 or in [0, {n}] (prompt), got {start!r}"
            )
        if not (_is_int(top) and 0 <= top <= vocab):
            raise RequestError(f"top_logprobs_num must be in [0, {vocab}], got {top!r}")
        if request.return_routed_experts and not self.config.record_routes:
            raise RequestError(
                "return_routed_experts: this engine does not record routes (build it with "
                "EmbeddedEngineConfig(record_routes=True), which routing.replay: rollout or "
                "routing.measure: true does in a run; MoE models only)"
            )
        routes_from = request.routed_experts_start_len
        if request.return_routed_experts and not (_is_int(routes_from) and 0 <= routes_from <= n):
            raise RequestError(
                f"routed_experts_start_len must be in [0, {n}] (prompt), got {routes_from!r}"
            )

    # ------------------------------------------------------------------ control

    async def pause(self, mode: str = "abort") -> None:
        """SGLang's pause modes: "abort" (abort everything), "in_place" (keep requests and KV),
        "retract" (requests go back to the queue; their context is prefilled again later)."""
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"pause mode {mode!r} is not one of 'abort', 'in_place', 'retract'")
        self._paused = True
        if mode == "abort":
            await self.abort_all("aborted by pause_generation")
        async with self._step_lock:
            if mode == "retract":
                self._waiting.extendleft(reversed(self._table.items))
                self._table = RowTable(self.num_rows)
            await self._settle_aborts()

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def _halted(self) -> bool:
        """No step may run: paused, or memory released."""
        return self._paused or bool(self._released)

    async def load_state_dict(self, full: dict[str, torch.Tensor], version: int) -> None:
        """Load full (global, Megatron-named) tensors on every rank of the TP group, between steps;
        requests in flight continue with the new weights (SGLang's semantics)."""
        async with self._step_lock:
            if MemoryTag.WEIGHTS in self._released:
                raise RequestError(
                    "the weights are released (release_memory_occupation); "
                    "resume_memory_occupation with tag 'weights' before loading weights"
                )
            await self._run(Step("load", state=full))
            self._version = version
            self._table.drop_parked()

    async def state_dict(self, keys: frozenset[str] | None = None) -> dict[str, torch.Tensor]:
        """The full (global, Megatron-named) host tensors of the served weights, gathered from every
        rank of the TP group between steps (keys and shapes of ``geometry.full_state_dict``; only
        ``keys`` when given)."""
        return _assemble(await self.call(functools.partial(_host_pieces, keys=keys)))

    async def call(self, fn: Callable[[EmbeddedEngine], Any]) -> list[Any]:
        """Run ``fn(engine)`` on every rank of the TP group between steps (on the thread that runs
        steps) and return each rank's result, TP rank 0 first. A rank whose ``fn`` raises is
        reported in one ``RuntimeError`` naming it (the peers go on following)."""
        async with self._step_lock:
            results = await self._run(Step("call", fn=fn))
        failed = [f"TP rank {r}: {err}" for r, (ok, err) in enumerate(results) if not ok]
        if failed:
            raise RuntimeError("; ".join(failed))
        return [value for _, value in results]

    def mark_weights_updated(self, version: int) -> None:
        """Record the version of weights written into ``model_chunks`` by an external reshard
        (every rank calls it; the engine must not be serving during the reshard)."""
        if version != self._version and self.is_scheduler:
            self._table.drop_parked()
        self._version = version

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        """Start the scheduler loop (scheduler rank, inside a running event loop)."""
        if not self.is_scheduler:
            raise RuntimeError("only TP rank 0 schedules; the other ranks call follow()")
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        if self.config.step_thread:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._task = asyncio.create_task(self._loop())

    async def shutdown(self) -> None:
        """Abort what is left, stop the loop and release the TP peers (scheduler rank)."""
        if self._task is None:
            return
        await self.abort_all("engine shut down")
        async with self._step_lock:
            await self._settle_aborts()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            if self._tp > 1:
                await self._run(Step("stop"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._task = None

    def follow(self) -> None:
        """Execute the scheduler's steps until it stops (TP ranks other than 0)."""
        while True:
            step = self._broadcast(None)
            if step.kind == "stop":
                return
            self._execute(step)

    def _check_running(self) -> None:
        if self._failed is not None:
            raise EngineError(f"embedded engine failed: {self._failed!r}")
        if self._task is None:
            raise EngineError("embedded engine is not running; call start() (run_engine does)")

    async def _loop(self) -> None:
        try:
            while True:
                try:  # an idle scheduler pings its peers (module docstring)
                    async with asyncio.timeout(PING_INTERVAL_S if self._tp > 1 else None):
                        await self._wake.wait()
                except TimeoutError:
                    async with self._step_lock:
                        await self._run(Step("call"))
                    continue
                self._wake.clear()
                if not self.config.step_thread:
                    await asyncio.sleep(0)  # the tasks the last step woke run one await on
                async with self._step_lock:
                    await self._settle_aborts()
                    if self._halted:
                        continue
                    await self._admit()
                    if self._table.items:
                        await self._decode()
                if self._table.items or (self._waiting and not self._halted):
                    self._wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a failed step fails every request, never hangs one
            self._failed = err
            for entry in itertools.chain(self._waiting, self._table.items):
                if not entry.future.done():
                    entry.future.set_exception(EngineError(f"embedded engine failed: {err!r}"))
            raise

    async def _run(self, step: Step) -> torch.Tensor | None:
        if not self.config.step_thread:  # on the loop's thread (``EmbeddedEngineConfig``)
            return self._broadcast_and_execute(step)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._broadcast_and_execute, step)

    def _broadcast_and_execute(self, step: Step) -> torch.Tensor | None:
        if self._tp > 1:
            self._broadcast(step)
        return self._execute(step)

    def _broadcast(self, step: Step | None) -> Step:
        """Scheduler sends, peers receive (every rank of the TP group calls it, on its host twin:
        a step is host metadata -- token ids, lengths, slot moves; a "load" step's tensors are the
        host tensors ``load_state_dict`` was given, e.g. weights that arrived over HTTP)."""
        box = [step]
        dist.broadcast_object_list(box, src=self._src, group=host_group(self._tp_group))
        return box[0]

    # ------------------------------------------------------------------ scheduling

    async def _settle_aborts(self) -> None:
        for entry in [e for e in self._waiting if e.abort_message]:
            self._waiting.remove(entry)
            self._finish(entry, FinishReason(FinishType.ABORT, message=entry.abort_message))
        table = self._table
        for row in reversed(range(len(table.items))):
            entry = table.items[row]
            if entry.abort_message:
                table.release(row)
                self._finish(entry, FinishReason(FinishType.ABORT, message=entry.abort_message))

    async def _admit(self) -> None:
        """Prefill waiting requests in one forward, FIFO, as many as rows (after evicting parked
        sessions, oldest first) and ``max_prefill_tokens`` allow -- counted *padded*: sequences x
        the longest, since the prefill's attention pads to the longest (a context over the budget
        is prefilled alone); the rest wait. A request whose session has a parked row that its
        context extends prefills only the new tokens; requests with the same context (a GRPO
        group's prompt) share one prefill."""
        cfg, table = self.config, self._table
        admitted: list[tuple[EngineRequest, int]] = []  # (entry, cached tokens reused)
        num_seqs = width = 0  # sequences the forward computes, the longest's new tokens
        first: dict[tuple, int] = {}  # fresh (context, prompt start) -> its first admitted
        while self._waiting and len(admitted) < cfg.max_prefills_per_step:
            entry = self._waiting[0]
            context, session = entry.context, entry.request.session
            start = prompt_start(entry)
            reused = table.reusable(session, context)
            if start is not None:  # the prompt's logits from `start` on are computed
                reused = min(reused, start)
            key = (context, start)
            cost = 0 if not reused and key in first else len(context) - reused
            if cost and admitted and (num_seqs + 1) * max(width, cost) > cfg.max_prefill_tokens:
                break
            if not reused:
                table.forget(session)
            takes = session if reused else None
            while not table.can_add(takes) and table.evict(keep={session}):
                pass
            if not table.can_add(takes):
                break  # every row is running: wait for one to finish
            self._waiting.popleft()
            table.add(entry, len(context), takes)
            entry.cached_tokens, entry.kv_version = reused, self._version
            if not reused:
                first.setdefault(key, len(admitted))
            admitted.append((entry, reused))
            if cost:
                num_seqs, width = num_seqs + 1, max(width, cost)
        if admitted:
            await self._prefill(admitted, first)

    async def _prefill(
        self, admitted: list[tuple[EngineRequest, int]], first: dict[tuple, int]
    ) -> None:
        """One forward over the admitted requests' uncached tokens (rows ``[n - k, n)``); a
        request asking for prompt log-probs gets the logits of its prompt from its
        ``logprob_start_len`` on (only then: ``Batch.logits_from``)."""
        row0 = len(self._table.items) - len(admitted)
        seq_of: list[int] = []  # the batch sequence of each admitted request
        rows, tokens, starts, shared, froms = [], [], [], [], []
        for i, (entry, reused) in enumerate(admitted):
            context, start = entry.context, prompt_start(entry)
            owner = None if reused else first[(context, start)]
            if owner is not None and owner != i:  # the same context: share the owner's prefill
                shared[seq_of[owner]].append(row0 + i)
                seq_of.append(seq_of[owner])
                continue
            seq_of.append(len(rows))
            rows.append(row0 + i)
            tokens.append(context[reused:])
            starts.append(reused)
            shared.append([])
            froms.append(len(context) - reused - 1 if start is None else start - reused)
        prompt = any(f < len(t) - 1 for f, t in zip(froms, tokens))
        batch = Batch(
            tuple(rows),
            tuple(tokens),
            tuple(starts),
            tuple(map(tuple, shared)),
            tuple(froms) if prompt else (),
        )
        entries = [entry for entry, _ in admitted]
        start = time.perf_counter()
        logits = await self._forward_or_fail(batch, entries)
        self.pace_stats.record_prefill(time.perf_counter() - start)
        if logits is None:
            return
        # The logits stay on the device (``_accept`` samples there).
        ended: dict[int, FinishReason | str] = {}  # entries that take no token from this step
        if prompt:
            ends = list(itertools.accumulate(len(t) - f for t, f in zip(tokens, froms)))
            ended = self._prompt_logprobs(logits, ends, seq_of, entries)
            seq_of = [ends[s] - 1 for s in seq_of]  # the sequence's last row
        for i, entry in enumerate(entries):
            if entry.request.sampling.max_new_tokens == 0 and i not in ended:
                ended[i] = FinishReason(FinishType.LENGTH)  # prefill only
        # One row per sequence; each request reads its sequence's row.
        if seq_of != list(range(logits.size(0))):
            logits = logits[host_to(torch.tensor(seq_of, dtype=torch.long), logits.device)]
        self._accept(logits, entries, ended)

    async def _decode(self) -> None:
        """Decode one token for every running row, in one forward; paced
        (``pace_decode_s``): the step then lasts at least the pace (a sleep after the forward)."""
        table = self._table
        batch = Batch.decode(table.lengths, [entry.output_ids[-1] for entry in table.items])
        start = time.perf_counter()
        logits = await self._forward_or_fail(batch, list(table.items))
        forward_s = time.perf_counter() - start
        pace = self.pace_stats
        while (left := pace.pace_s - (time.perf_counter() - start)) > 0:
            await asyncio.sleep(left)  # the loop may wake a clock tick early: sleep again
        step_s = time.perf_counter() - start
        pace.sleep_s += step_s - forward_s if pace.pace_s > forward_s else 0.0
        pace.record(forward_s, step_s)
        if logits is not None:
            table.lengths = [n + 1 for n in table.lengths]
            self._accept(logits, list(table.items))

    async def _forward_or_fail(
        self, batch: Batch, entries: list[EngineRequest]
    ) -> torch.Tensor | None:
        """The step's forward; when it raises (TP1), only ``entries`` -- the requests in it --
        fail and the loop goes on. ``MAX_FORWARD_FAILURES`` failures in a row, or any with
        tp > 1 (the peers may be out of step), fail the engine."""
        try:
            logits = await self._run(Step("forward", batch, self._table.take_moves()))
        except Exception as err:
            self._forward_failures += 1
            if self._tp > 1 or self._forward_failures >= MAX_FORWARD_FAILURES:
                raise
            self._retire([(e, f"the engine's forward failed: {err!r}") for e in entries])
            return None
        self._forward_failures = 0
        return logits

    # ------------------------------------------------------------------ execution (all ranks)

    def _execute(self, step: Step) -> torch.Tensor | None:
        """Run one step on this rank; a forward returns full-vocab logits [k, V] (fp32) at the
        last new token of each of its sequences."""
        if step.kind == "load":
            from megatron_earl.redistribute.geometry import load_full_state_dict

            load_full_state_dict(self.model_chunks, step.state)
            return None
        if step.kind == "stop":
            return None
        if step.kind == "release":
            self._release_local(step.tags)
            return None
        if step.kind == "resume":
            self._resume_local(step.tags)
            return None
        if step.kind == "call":
            return self._call(step.fn)
        for src, dst, length in step.moves:
            self._forward.move_row(src, dst, length)
        threads = self._threads[step.batch.is_decode]
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return self._forward(step.batch)

    def _call(self, fn: Callable[[EmbeddedEngine], Any] | None) -> list[tuple[bool, Any]] | None:
        """Run ``fn`` here and gather (ok, result or error message) of every rank of the TP group
        to the scheduler (every rank of the group calls it, host group); None on the peers."""
        try:
            outcome = (True, None if fn is None else fn(self))
        except Exception as err:  # reported to the scheduler; this rank goes on following
            outcome = (False, f"{type(err).__name__}: {err}")
        if self._tp == 1:
            return [outcome]
        box = [None] * self._tp if self.is_scheduler else None
        dist.gather_object(outcome, box, dst=self._src, group=host_group(self._tp_group))
        return box


def _host_pieces(
    engine: EmbeddedEngine, keys: frozenset[str] | None = None
) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """(key, global shape, region, host copy) of every main-replica piece this rank holds (of
    ``keys`` only, when given)."""
    from megatron_earl.redistribute.geometry import shard_pieces

    return [
        (p.key, p.global_shape, p.region, runtime.to_host(p.region_view()).clone())
        for p in shard_pieces(engine.model_chunks)
        if not p.is_replica and (keys is None or p.key in keys)
    ]


def _assemble(ranks: list[list[tuple[str, tuple, tuple, torch.Tensor]]]) -> dict:
    """Full tensors from the pieces of every rank (``_host_pieces``); each must be covered."""
    from megatron_earl.redistribute.geometry import region_slices

    full: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for pieces in ranks:
        for key, shape, region, tensor in pieces:
            out = full.setdefault(key, torch.empty(shape, dtype=tensor.dtype))
            out[region_slices(region)] = tensor
            covered[key] = covered.get(key, 0) + tensor.numel()
    missing = {k: (covered[k], v.numel()) for k, v in full.items() if covered[k] != v.numel()}
    if missing:
        raise RuntimeError(f"the TP group's pieces do not cover (covered, total): {missing}")
    return full


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def run_engine(
    engine: EmbeddedEngine, driver: Callable[[EmbeddedEngine], Awaitable[T]]
) -> T | None:
    """Serve ``driver(engine)`` to completion and stop the engine.

    Every rank of the engine's TP group calls it: the scheduler (TP rank 0) runs the driver in a
    fresh event loop and returns its result; the other ranks execute steps and return None.
    Steps run on this thread on the other ranks (and on the scheduler without a step thread)
    set its torch thread count per step kind; the caller gets its own count back.
    """
    threads = torch.get_num_threads()
    try:
        if not engine.is_scheduler:
            engine.follow()
            return None

        async def main() -> T:
            await engine.start()
            try:
                return await driver(engine)
            finally:
                await engine.shutdown()

        return event_loop.run(main())
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def drive_all(engine: Any, requests: Sequence[GenerateRequest]) -> Awaitable[list[GenerateResult]]:
    """Submit ``requests`` concurrently to ``engine`` and gather the results (a driver helper)."""
    return asyncio.gather(*(engine.generate(r) for r in requests))
