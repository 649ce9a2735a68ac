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
  and brings recovered ones back.

``choose_engine`` is the pure routing rule.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_earl.rollout.engine import Engine, EngineError, GenerateRequest, GenerateResult
from megatron_earl.rollout.sglang_client import EngineRequestError


@dataclass(frozen=True)
class PoolConfig:
    """Failover and health checking of an engine pool."""

    max_failovers: int = 2
    """Other engines a failed request is retried on."""
    health_interval_s: float = 5.0
    """Period of the background health checks (``start_health_checks``)."""

    def __post_init__(self) -> None:
        if self.max_failovers < 0 or self.health_interval_s <= 0:
            raise ValueError(
                f"need max_failovers >= 0 and health_interval_s > 0, got "
                f"{self.max_failovers}, {self.health_interval_s}"
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
            try:
                return await self.engines[index].generate(request)
            except EngineRequestError:
                raise
            except EngineError as err:
                errors.append(f"{self.engines[index]!r}: {err}")
                self.healthy[index] = False
                if attempt < self.config.max_failovers and any(self.healthy):
                    self.failovers += 1
                    continue
                break
            finally:
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
        """Poll every engine; unhealthy ones that answer come back into rotation."""
        results = await asyncio.gather(*(e.health() for e in self.engines), return_exceptions=True)
        self.healthy = [r is True for r in results]
        return list(self.healthy)

    def end_session(self, session: str) -> None:
        """Forget a finished trajectory's engine."""
        self._sessions.pop(session, None)

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
        for engine in self.engines:
            close = getattr(engine, "close", None)
            if close is not None:
                await close()

    def _sticky(self, session: str | None) -> int | None:
        return None if session is None else self._sessions.get(session)
