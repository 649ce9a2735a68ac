"""One weight version per trajectory on the engines, and Laminar's long-tail repack
(``rollout.repack``: ``drain`` or ``repack``, ``config.repack``).

    config = RepackConfig(policy=RepackPolicy.REPACK)
    placement = Placement(pool, relay_of_engine, config, holder="rank0")
    placement.start()                       # inside the producer's event loop
    placement.set_newest(version)           # the trainer published ``version``
    await placement.begin(uid)              # waits for an engine on the newest version, pins uid
    ...                                     # the agent loop's turns go to the pinned engine
    placement.end(uid)
    await placement.close()                 # releases every engine (nothing of ours is left)

Each rank's asynchronous producer (``orchestration.async_rollout``) owns one placement over the
engines themselves (no router: the producer must know where each trajectory is). The rule:

- **New trajectories** start only on a healthy engine that serves the newest published version
  (the one holding fewest of this rank's trajectories; ties: lowest index). While none does,
  ``begin`` waits. A trajectory is pinned to its engine (``EnginePool`` session stickiness),
  so all its turns run on the weights it started with.
- **Draining.** An engine behind the newest version takes no new trajectory. When it holds none
  of this rank's trajectories and none of its requests, the placement releases it to the relay
  that feeds it (``POST /engines/release``); the relay (``--release-holders`` = the trainer's
  process count) loads the newest version once every rank released it. Then it serves new
  trajectories again.
- **Repack** (``policy: repack``): every ``interval_s`` the placement plans (``plan_repack``,
  pure) moves among draining engines of one version: an engine holding at most ``below`` of
  this rank's trajectories hands them to the lowest-index engine of that version that holds
  this rank's trajectories (if it then holds at most ``max_per_engine``). Each rank plans over
  its own trajectories: ranks whose tails are on the same engines pick the same target, ranks
  whose tails are on different engines may pick different ones (an engine is freed only when
  every rank released it). A moved trajectory's request in
  flight finishes where it runs; its next turn is prefilled on the target from its tokens (the
  same weights: the engines are on the same version). Each move is logged and counted.

Faults keep their meaning: a failed or stalled engine's requests move to another engine
(``EnginePool``), whatever its version; the turn is tagged with the older version, so
staleness is never under-counted. ``timeline`` (JSON lines, one per ``interval_s``) records
every engine's version, this rank's trajectories and requests on it, and the repack and
release events: the engine-utilisation plot of ``megatron-earl bench repack``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from megatron_earl.config.repack import RepackConfig
from megatron_earl.config.vocab import RepackPolicy
from megatron_earl.rollout.sglang.pool import EnginePool
from megatron_earl.rollout.weights.relay.wire import auth_headers

log = logging.getLogger("megatron_earl.repack")

RELEASE_AGAIN_S = 2.0
"""A release not followed by a load within this long is sent again (a restarted relay forgot
it)."""


@dataclass(frozen=True)
class EngineView:
    """What one rank's placement knows of an engine when it plans."""

    version: int
    """Weight version it serves (-1: not known yet)."""
    healthy: bool
    trajectories: int
    """This rank's trajectories pinned to it."""


@dataclass(frozen=True)
class Move:
    """Move every trajectory of this rank on ``source`` to ``target`` (same version)."""

    source: int
    target: int
    trajectories: int
    version: int


def plan_repack(
    engines: Sequence[EngineView], newest: int, below: int, max_per_engine: int
) -> list[Move]:
    """Moves that empty draining engines (behind ``newest``) holding at most ``below``
    trajectories into the lowest-index draining engine of the same version that holds
    trajectories, while it then holds at most ``max_per_engine``."""
    counts = [e.trajectories for e in engines]
    by_version: dict[int, list[int]] = {}
    for i, e in enumerate(engines):
        if e.healthy and 0 <= e.version != newest and counts[i] > 0:
            by_version.setdefault(e.version, []).append(i)
    moves = []
    for version in sorted(by_version):
        target, *sources = by_version[version]
        for source in sources:
            n = counts[source]
            if n <= below and counts[target] + n <= max_per_engine:
                moves.append(Move(source, target, n, version))
                counts[target] += n
                counts[source] = 0
    return moves


def release_holder_problems(holders_of: dict[str, object], holders: int) -> list[str]:
    """What is wrong with the engine relays' ``--release-holders`` for ``holders`` producers
    (``holders_of``: relay URL -> what its ``/relay_info`` says, ``relay_holders``). Each relay
    must wait for every producer's release before loading its engine, so its value must be
    ``holders`` (fewer loads an engine under another rank's trajectories; more never loads
    it). Pure."""
    problems = []
    for url, value in holders_of.items():
        if isinstance(value, str):  # why it did not tell
            problems.append(f"engine relay {url} did not tell its --release-holders: {value}")
        elif value != holders:
            problems.append(
                f"engine relay {url} was started with --release-holders {value!r}; "
                f"rollout.repack needs {holders} (one release per trainer process): restart it "
                f"with --release-holders {holders}"
            )
    return problems


def relay_holders(relays: Sequence[str], timeout_s: float = 30.0) -> dict[str, object]:
    """Each relay's ``--release-holders`` as its ``/relay_info`` reports it, or a sentence
    saying why it did not (no answer, no such field). Local (one process asks; the trainer's
    rank 0 does and broadcasts the answers, ``RLLoop``)."""

    async def ask() -> list[object]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(headers=auth_headers(), timeout=timeout) as session:

            async def one(url: str) -> object:
                try:
                    async with session.get(f"{url.rstrip('/')}/relay_info") as resp:
                        resp.raise_for_status()
                        info = await resp.json()
                except (aiohttp.ClientError, TimeoutError, ValueError) as err:
                    return f"no answer from /relay_info ({type(err).__name__}: {err})"
                if not isinstance(info, dict) or "release_holders" not in info:
                    return "its /relay_info has no release_holders (not a megatron-earl relay?)"
                return info["release_holders"]

            return await asyncio.gather(*(one(url) for url in relays))

    return dict(zip(relays, asyncio.run(ask()), strict=True))


class Placement:
    """This rank's trajectories across engines and weight versions (module docstring)."""

    def __init__(
        self,
        pool: EnginePool,
        relays: Sequence[str],
        config: RepackConfig,
        holder: str,
        timeline: Path | None = None,
    ) -> None:
        if len(relays) != len(pool.engines):
            raise ValueError(
                f"repack: {len(relays)} engine relays for {len(pool.engines)} engines; "
                "rollout.sglang.engine_relays lists the relay of each engine"
            )
        self.pool = pool
        self.relays = [r.rstrip("/") for r in relays]
        self.config = config
        self.holder = holder
        self.newest = -1
        self.open: set[str] = set()
        """This rank's trajectories begun and not ended."""
        self.repacks = 0
        """Moves made (one source engine emptied into a target)."""
        self.repacked_trajectories = 0
        self.releases = 0
        self.waits = 0
        """Trajectories that waited in ``begin`` for an engine on the newest version."""
        self.wait_s = 0.0
        self._released: dict[int, tuple[int, float]] = {}
        self._attached: set[int] = set()
        """Engines whose relay acknowledged this holder's attach (``_attach_all``)."""
        self._changed = asyncio.Event()
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._attacher: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._timeline = timeline.open("a") if timeline is not None else None

    # -- what the producer calls ------------------------------------------------------------
    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            headers=auth_headers(), timeout=aiohttp.ClientTimeout(total=10, sock_connect=3)
        )
        self._task = asyncio.create_task(self._run(), name="repack")

    def set_newest(self, version: int) -> None:
        if version > self.newest:
            self.newest = version
            self._kick.set()  # read the engines' versions now, not at the next tick

    async def begin(self, uid: str) -> int:
        """Pin trajectory ``uid`` to an engine on the newest version (waits for one)."""
        start = None
        while True:
            index = self._choose()
            if index is not None:
                break
            if start is None:
                start, self.waits = time.perf_counter(), self.waits + 1
            changed = self._changed
            await changed.wait()
        if start is not None:
            self.wait_s += time.perf_counter() - start
        self.open.add(uid)
        self.pool.pin(uid, index)
        return index

    def end(self, uid: str) -> None:
        self.open.discard(uid)
        self.pool.end_session(uid)
        self._notify()

    async def close(self) -> None:
        """Stop planning and detach from every engine: this rank holds nothing any more, and
        later versions (the final evaluation's) must not wait for it."""
        if self._attacher is not None:
            self._attacher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._attacher
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.open.clear()
        if self._session is not None:
            await asyncio.gather(
                *(self._release(i, detach=True) for i in range(len(self.relays))),
                return_exceptions=True,
            )
            await self._session.close()
        if self._timeline is not None:
            self._timeline.close()

    def stats(self) -> dict[str, float]:
        return {
            "repack_moves": float(self.repacks),
            "repack_trajectories": float(self.repacked_trajectories),
            "repack_releases": float(self.releases),
            "repack_waits": float(self.waits),
            "repack_wait_s": self.wait_s,
        }

    # -- state ------------------------------------------------------------------------------
    def counts(self) -> list[int]:
        """This rank's open trajectories per engine."""
        out = [0] * len(self.pool.engines)
        for uid in self.open:
            index = self.pool.engine_of(uid)
            if index is not None:
                out[index] += 1
        return out

    def versions(self) -> list[int]:
        return [e.weight_version for e in self.pool.engines]

    def _choose(self) -> int | None:
        if self.newest < 0:
            return None
        counts, versions = self.counts(), self.versions()
        serving = [
            i
            for i, ok in enumerate(self.pool.healthy)
            if ok and versions[i] == self.newest and i in self._attached
        ]
        return min(serving, key=lambda i: (counts[i], i), default=None)

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # -- the periodic task ------------------------------------------------------------------
    async def _run(self) -> None:
        self._attacher = asyncio.create_task(self._attach_all(), name="repack-attach")
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.config.interval_s)
            self._kick.clear()
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a relay or engine fault: try again next tick
                log.warning("repack (%s): %s", self.holder, err)

    async def _attach_all(self) -> None:
        """Attach to the relay of every engine (a holder that stopped earlier, a resumed run,
        holds its engines again), then release it (this rank holds nothing on it yet, so it
        may take the first version). Until its relay has acknowledged, an engine takes none
        of this rank's trajectories (``_choose``): a detach left standing would let the relay
        load it under them. Relays that failed are tried again every ``RELEASE_AGAIN_S``, in
        this task (the ticks do not wait for them); each failing relay is logged once."""
        warned: set[int] = set()
        while True:
            missing = [i for i in range(len(self.relays)) if i not in self._attached]
            results = await asyncio.gather(
                *(self._release(i, attach=True) for i in missing), return_exceptions=True
            )
            attached = [i for i, r in zip(missing, results, strict=True) if r is None]
            for i, result in zip(missing, results, strict=True):
                if result is not None and i not in warned:
                    warned.add(i)
                    log.warning(
                        "repack (%s): attach to %s failed (%s); its engine takes none of this "
                        "rank's trajectories until it answers",
                        self.holder,
                        self.relays[i],
                        result,
                    )
            self._attached.update(attached)
            await asyncio.gather(*(self._release(i) for i in attached), return_exceptions=True)
            if attached:
                self._notify()
            if len(self._attached) == len(self.relays):
                return
            await asyncio.sleep(RELEASE_AGAIN_S)

    async def _tick(self) -> None:
        try:
            await self._plan_and_release()
        finally:
            self._notify()

    async def _plan_and_release(self) -> None:
        """Read the versions of engines behind the newest, repack, release the empty ones."""
        behind = [i for i, v in enumerate(self.versions()) if v != self.newest]
        if behind:  # their relays may have loaded them since
            await asyncio.gather(
                *(_read_version(self.pool.engines[i]) for i in behind), return_exceptions=True
            )
        versions = self.versions()
        for i in list(self._released):
            if versions[i] == self.newest:
                del self._released[i]
        if self.config.policy == RepackPolicy.REPACK:
            self._repack(versions)
        counts = self.counts()
        now = time.monotonic()
        due = []
        for i, version in enumerate(versions):
            if version == self.newest or counts[i] or self.pool.loads[i]:
                continue
            sent = self._released.get(i)
            if sent is None or sent[0] != self.newest or now - sent[1] > RELEASE_AGAIN_S:
                self._released[i] = (self.newest, now)
                due.append(i)
        results = await asyncio.gather(
            *(self._release(i, version=versions[i]) for i in due), return_exceptions=True
        )
        for i, result in zip(due, results, strict=True):
            if isinstance(result, Exception):  # this relay only: the others were released
                log.warning("repack (%s): release of engine %d: %s", self.holder, i, result)
        self._record(versions, counts)

    def _repack(self, versions: list[int]) -> None:
        counts = self.counts()
        views = [EngineView(v, ok, n) for v, ok, n in zip(versions, self.pool.healthy, counts)]
        moves = plan_repack(views, self.newest, self.config.below, self.config.max_per_engine)
        for move in moves:
            for uid in [u for u in self.open if self.pool.engine_of(u) == move.source]:
                self.pool.pin(uid, move.target)
            self.repacks += 1
            self.repacked_trajectories += move.trajectories
            log.info(
                "repack (%s): %d trajectories of version %d from engine %d to engine %d",
                self.holder,
                move.trajectories,
                move.version,
                move.source,
                move.target,
            )
            self._event("repack", **move.__dict__)

    async def _release(
        self,
        index: int,
        detach: bool = False,
        attach: bool = False,
        version: int | None = None,
    ) -> None:
        """Release engine ``index`` to its relay (``version``: the one this rank saw it serve;
        the relay refuses a release for another, 409: the engine was loaded since, nothing to
        do), or detach from / attach to it."""
        url = self.relays[index]
        body = {"engine": self.pool.engines[index].base_url, "holder": self.holder}
        if detach or attach:
            body["detach" if detach else "attach"] = True
        if version is not None:
            body["version"] = version
        assert self._session is not None
        async with self._session.post(f"{url}/engines/release", json=body) as resp:
            if resp.status == 409:
                return
            if resp.status != 200:
                raise RuntimeError(
                    f"relay {url} refused {body}: HTTP {resp.status} {(await resp.text())[:300]}"
                )
        if attach:
            return
        self.releases += 1
        event = "detach" if detach else "release"
        self._event(event, engine=index, version=self.versions()[index], newest=self.newest)

    def _record(self, versions: list[int], counts: list[int]) -> None:
        if self._timeline is None:
            return
        engines = [
            [v, n, load] for v, n, load in zip(versions, counts, self.pool.loads, strict=True)
        ]
        self._write({"newest": self.newest, "engines": engines})

    def _event(self, event: str, **fields) -> None:
        if self._timeline is not None:
            self._write({"event": event, **fields})

    def _write(self, record: dict) -> None:
        assert self._timeline is not None
        self._timeline.write(
            json.dumps({"t": round(time.time(), 3), "holder": self.holder, **record}) + "\n"
        )
        self._timeline.flush()


async def _read_version(client) -> None:
    """Refresh ``client.weight_version`` (bounded: a stalled engine must not hold the tick)."""
    await asyncio.wait_for(client.get_model_info(), 2.0)
