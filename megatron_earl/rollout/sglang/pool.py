"""A pool of engines behind one ``Engine``: least-loaded routing, session stickiness, failover.

    pool = EnginePool([SGLangClient(url) for url in urls])
    result = await pool.generate(GenerateRequest(ids, params, session="traj-17"))

* Routing: a request with a ``session`` (trajectory id) goes to the engine that served the
  session before (its prefix cache holds the conversation), while that engine is healthy;
  otherwise to the healthy engine with the fewest requests in flight (ties: lowest index).
* Failover: an ``EngineError`` that is not the caller's fault (unreachable, crashed, timed out after
  the client's own retries) marks the engine unhealthy and the request is retried on another
  engine (``max_failovers`` times); the session moves with it. A rejected request
  (``EngineRequestError``, HTTP 4xx) is raised at once.
* Health: ``check_health()`` (or the periodic task of ``start_health_checks``) polls every engine
  (``/health`` within ``health_timeout_s``) and brings recovered ones back. An engine that fails
  ``unhealthy_after`` checks in a row is taken out, and the requests it holds are moved: a
  stopped or partitioned engine (its socket open, no answer) would otherwise hold them until
  the client's request timeout. The moved request's abort is sent to it (in case it comes back)
  and its result, if any, is never used: a request is answered once.

``choose_engine`` is the pure routing rule.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_earl.rollout.engine import Engine, EngineError, GenerateRequest, GenerateResult
from megatron_earl.rollout.sglang.client import EngineRequestError


@dataclass(frozen=True)
class PoolConfig:
    """Failover and health checking of an engine pool."""

    max_failovers: int = 2
    """Other engines a failed request is retried on."""
    health_interval_s: float = 5.0
    """Period of the background health checks (``start_health_checks``)."""
    health_timeout_s: float = 5.0
    """A health check not answered within this fails."""
    unhealthy_after: int = 2
    """Consecutive failed checks after which an engine's in-flight requests move elsewhere."""

    def __post_init__(self) -> None:
        if (
            self.max_failovers < 0
            or self.health_interval_s <= 0
            or self.health_timeout_s <= 0
            or self.unhealthy_after < 1
        ):
            raise ValueError(
                f"need max_failovers >= 0, health_interval_s > 0, health_timeout_s > 0 and "
                f"unhealthy_after >= 1, got {self.max_failovers}, {self.health_interval_s}, "
                f"{self.health_timeout_s}, {self.unhealthy_after}"
            )


def choose_engine(loads: Sequence[int], healthy: Sequence[bool], sticky: int | None) -> int:
    """Index of the engine for a request: the sticky one if healthy, else the least loaded."""
    if sticky is not None and healthy[sticky]:
        return sticky
    candidates = [i for i, ok in enumerate(healthy) if ok]
    if not candidates:
        raise EngineError("no healthy engine in the pool")
    return min(candidates, key=lambda i: (loads[i], i))


class EnginePool:
    """Routes requests over several engines; implements the ``Engine`` protocol."""

    def __init__(self, engines: Sequence[Engine], config: PoolConfig | None = None) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self.config = config or PoolConfig()
        self.loads = [0] * len(self.engines)
        self.healthy = [True] * len(self.engines)
        self.failovers = 0
        """Requests moved to another engine after a failure (a metric)."""
        self.moved_from_stalled = 0
        """In-flight requests taken from an engine that stopped answering health checks."""
        self._failed_checks = [0] * len(self.engines)
        self._inflight: list[set[asyncio.Task]] = [set() for _ in self.engines]
        self._stalled: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()
        self._sessions: dict[str, int] = {}
        self._rids: dict[str, int] = {}
        self._health_task: asyncio.Task | None = None

    @property
    def weight_version(self) -> int:
        """Oldest weight version among healthy engines (what a new request may get)."""
        versions = [e.weight_version for e, ok in zip(self.engines, self.healthy) if ok]
        return min(versions, default=-1)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        errors: list[str] = []
        for attempt in range(self.config.max_failovers + 1):
            index = choose_engine(self.loads, self.healthy, self._sticky(request.session))
            if request.session is not None:
                self._sessions[request.session] = index
            if request.rid:
                self._rids[request.rid] = index
            self.loads[index] += 1
            call = asyncio.ensure_future(self.engines[index].generate(request))
            self._inflight[index].add(call)
            try:
                return await call
            except EngineRequestError:
                raise
            except (EngineError, asyncio.CancelledError) as err:
                if isinstance(err, asyncio.CancelledError):
                    if call not in self._stalled:  # our caller cancelled us
                        call.cancel()
                        raise
                    self._stalled.discard(call)
                    err = EngineError("stopped answering health checks; request moved")
                    self._abort_later(index, request.rid)
                errors.append(f"{self.engines[index]!r}: {err}")
                self.healthy[index] = False
                if attempt < self.config.max_failovers and any(self.healthy):
                    self.failovers += 1
                    continue
                break
            finally:
                self._inflight[index].discard(call)
                self.loads[index] -= 1
                if request.rid:
                    self._rids.pop(request.rid, None)
        raise EngineError("request failed on every engine tried: " + "; ".join(errors))

    async def abort(self, rid: str) -> None:
        index = self._rids.get(rid)
        targets = [self.engines[index]] if index is not None else self.engines
        await asyncio.gather(*(e.abort(rid) for e in targets), return_exceptions=True)

    async def health(self) -> bool:
        await self.check_health()
        return any(self.healthy)

    async def check_health(self) -> list[bool]:
        """Poll every engine; unhealthy ones that answer come back into rotation, and one that
        failed ``unhealthy_after`` checks in a row has its in-flight requests moved."""
        timeout = self.config.health_timeout_s
        results = await asyncio.gather(
            *(_bounded_health(e, timeout) for e in self.engines), return_exceptions=True
        )
        self.healthy = [r is True for r in results]
        for index, ok in enumerate(self.healthy):
            self._failed_checks[index] = 0 if ok else self._failed_checks[index] + 1
            if self._failed_checks[index] >= self.config.unhealthy_after:
                for call in list(self._inflight[index]):
                    if not call.done() and call not in self._stalled:
                        self._stalled.add(call)
                        self.moved_from_stalled += 1
                        call.cancel()
        return list(self.healthy)

    def _abort_later(self, index: int, rid: str | None) -> None:
        """Send ``rid``'s abort to engine ``index`` in the background (it may be stopped)."""
        if not rid:
            return

        async def abort() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engines[index].abort(rid), 30)

        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def end_session(self, session: str) -> None:
        """Forget a finished trajectory's engine."""
        self._sessions.pop(session, None)

    def pin(self, session: str, index: int) -> None:
        """Send ``session``'s next requests to engine ``index`` (while it is healthy)."""
        if not 0 <= index < len(self.engines):
            raise ValueError(f"engine index {index} not in [0, {len(self.engines)})")
        self._sessions[session] = index

    def engine_of(self, session: str) -> int | None:
        """The engine ``session``'s requests go to (None: not routed yet)."""
        return self._sessions.get(session)

    def start_health_checks(self) -> None:
        """Poll health every ``health_interval_s`` in the background (inside the event loop)."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.config.health_interval_s)
                await self.check_health()

        self._health_task = asyncio.create_task(loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for engine in self.engines:
            close = getattr(engine, "close", None)
            if close is not None:
                await close()

    def _sticky(self, session: str | None) -> int | None:
        return None if session is None else self._sessions.get(session)


async def _bounded_health(engine: Engine, timeout_s: float) -> bool:
    """``engine.health()`` within ``timeout_s`` (False after it)."""
    try:
        return await asyncio.wait_for(engine.health(), timeout_s)
    except asyncio.TimeoutError:
        return False
