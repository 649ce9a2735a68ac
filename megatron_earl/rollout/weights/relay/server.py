"""``megatron-earl relay``: one relay of the weight service (Laminar's relay tier).

    megatron-earl relay --port 31000                  # a root: the trainer publishes here
    megatron-earl relay --port 31001 --upstream http://root:31000 \\
        --engines http://10.0.0.5:30000,http://10.0.0.6:30000   # pulls, feeds its engines

A relay holds weight versions (``versions.VersionStore``: immutable, complete or absent) and
passes them on without the trainer:

- **Receiving.** The trainer (``publisher.RelayPublisher``) publishes each version once to a
  root relay: ``POST /versions/{v}/begin?generation=G`` (``versions``: a resumed trainer is a
  newer generation and may publish a lower number), ``PUT /versions/{v}/buckets/{i}`` (the bucket's
  bytes, ``X-Sha256`` its checksum: a body that does not hash to it is refused with 422 and
  stored nowhere), ``POST /versions/{v}/commit`` (the manifest: every bucket's checksum, size
  and tensor count; a missing or differing bucket is a 409 and nothing is served).
- **Fan-out.** A relay started with ``--upstream A[,B...]`` pulls every new version from
  whichever upstream has the newest (``GET /versions/latest?after_generation=G&after=V&wait_s=T``,
  a long poll),
  bucket by bucket, checks each against the manifest's checksum (the trainer's), re-pulls a
  bucket that does not match from another upstream (``checksum_refused``, ``repulls``) and
  commits only a complete version. Relays chain or form a tree this way; an upstream that
  fails is skipped for the next (``upstream_errors``).
- **Engines.** For each URL of ``--engines`` an applier (``applier.py``) loads the newest
  version into that engine when it serves another one (SGLang's own API: ``pause_generation`` in
  ``--pause-mode``, ``update_weights_from_tensor`` per bucket with the version on the last one,
  ``continue_generation``, then ``get_model_info`` must report it, and a few tensors read back
  with ``get_weights_by_name`` must hold the published values: ``--verify-tensors``, see
  ``readback``; a difference is counted, ``engine_mismatches``, and the version loaded again;
  an engine without the endpoint is counted, ``engine_check_unsupported``, and not checked).
  Each engine on its own: a slow or dead engine delays nobody else; a failed apply is retried
  with backoff, and an engine that restarts (it reports another version) gets the newest
  version again. Each engine is fed by one relay: an applier's first call to its engine is
  ``continue_generation`` (a no-op when the engine runs), since a relay killed between its
  pause and its continue leaves the engine paused until a relay for it starts again.
- **Loading on release** (``--release-holders N``, for ``rollout.repack``: each trajectory on
  one weight version). An engine is then loaded with a newer version only once ``N`` holders
  (the trainer ranks' producers) released it since its last load (``POST /engines/release``,
  ``{"engine": URL, "holder": NAME}``): a holder releases an engine when none of its
  trajectories is on it, and detaches it when it stops (``"detach": true``: its release then
  stands for later versions until it attaches again). A release names the version the holder
  saw the engine serve (409 for another one). What an engine serves when the relay first
  reaches it counts as loaded (a restarted relay waits for releases too); a restarted engine,
  and a load whose read-back failed, are loaded again without a release.
- **Collection.** A version older than the newest is dropped once no applier is loading it and
  no child relay has fetched a bucket of it within ``--lease-s``.

``GET /relay_info`` reports the versions held and staged, every engine's state and the
counters (JSON). Errors answer ``{"error": {"message": ...}}`` with a 4xx naming the value.
Who may publish. With ``$EARL_RELAY_API_KEY`` set (here and on the publisher) every request
but ``GET``/``HEAD /health``, whatever its method or path spelling, needs
``Authorization: Bearer KEY``. A relay binds to 127.0.0.1 by default; bound to any other address
it refuses to start without a key (``--allow-no-key`` says the network is trusted). Without a
key every local process may publish, and a publish in a generation at or after the running
trainer's start refuses that trainer's later publications (409) until a trainer started later
publishes: the key is the only protection of a run in progress. What no caller can do, key or
not, is pin the relay for every future trainer: a generation (a publisher's start time in ms)
more than ``--max-clock-skew-s`` ahead of this relay's clock is refused with 400
(``generation=10**15`` was taken before, and then no trainer could ever publish again).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import math
import os
import signal
import time

import aiohttp
from aiohttp import web

from megatron_earl.compat.http_guard import bearer_matches, parse_json, route_path
from megatron_earl.config.vocab import PauseMode
from megatron_earl.rollout.engine import EngineError
from megatron_earl.rollout.weights.relay.applier import EngineApplier, EngineState, backoff_s
from megatron_earl.rollout.weights.relay.settings import Counters, RelaySettings
from megatron_earl.rollout.weights.relay.versions import (
    ChecksumError,
    Manifest,
    VersionError,
    VersionStore,
    digest,
)
from megatron_earl.rollout.weights.relay.wire import API_KEY_ENV, SHA_HEADER

log = logging.getLogger("megatron_earl.rollout.weights.relay")


class RelayServer:
    """The HTTP side and the background tasks of one relay (module docstring)."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self.store = VersionStore()
        self.counters = Counters()
        self.engines = {url: EngineState(url) for url in settings.engines}
        self._new_version = asyncio.Event()
        self._released = {url: asyncio.Event() for url in settings.engines}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._closing = False
        """Set at shutdown: pending long polls answer at once (the process exits promptly)."""

    # -- HTTP -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_bucket_bytes, middlewares=[self._middleware]
        )
        app.router.add_get("/health", self.health)
        app.router.add_get("/relay_info", self.info)
        app.router.add_post("/versions/{v}/begin", self.begin)
        app.router.add_put("/versions/{v}/buckets/{i}", self.put_bucket)
        app.router.add_post("/versions/{v}/commit", self.commit)
        app.router.add_get("/versions/latest", self.latest)
        app.router.add_get("/versions/{v}/buckets/{i}", self.get_bucket)
        app.router.add_post("/engines/release", self.release)
        app.on_startup.append(self._start_tasks)
        app.on_shutdown.append(self._end_long_polls)
        app.on_cleanup.append(self._stop_tasks)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        key = self.settings.api_key
        if key and route_path(request) != "/health":
            if not bearer_matches(request.headers.get("Authorization"), key):
                return _error(401, "missing or wrong Authorization: Bearer <EARL_RELAY_API_KEY>")
        try:
            return await handler(request)
        except ChecksumError as err:
            self.counters.checksum_refused += 1
            return _error(422, str(err))
        except VersionError as err:
            return _error(409, str(err))
        except web.HTTPException:
            raise
        except ValueError as err:
            return _error(400, str(err))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def info(self, request: web.Request) -> web.Response:
        latest = self.store.latest()
        return web.json_response(
            {
                "newest_version": None if latest is None else latest.version,
                "newest_generation": None if latest is None else latest.generation,
                "committed": self.store.committed_versions(),
                "staged": self.store.staged_versions(),
                "upstreams": list(self.settings.upstreams),
                "release_holders": self.settings.release_holders,
                "engines": {url: s.to_dict() for url, s in self.engines.items()},
                "counters": {
                    **{k: v for k, v in dataclasses.asdict(self.counters).items() if k != "extra"},
                    **self.counters.extra,
                },
            }
        )

    async def begin(self, request: web.Request) -> web.Response:
        generation = _query_int(request, "generation", 0)
        newest_allowed = time.time_ns() // 1_000_000 + int(self.settings.max_clock_skew_s * 1e3)
        if generation > newest_allowed:
            raise ValueError(
                f"generation {generation} is ahead of this relay's clock ({newest_allowed} ms "
                f"since the epoch, --max-clock-skew-s {self.settings.max_clock_skew_s:g} "
                "included); a generation is its publisher's start time in ms since the epoch"
            )
        self.store.begin(_int(request, "v"), generation)
        return web.json_response({"ok": True})

    async def put_bucket(self, request: web.Request) -> web.Response:
        sha = request.headers.get(SHA_HEADER)
        if not sha:
            raise ValueError(f"a bucket needs its checksum in the {SHA_HEADER} header")
        data = await request.read()
        self.store.put(_int(request, "v"), _int(request, "i"), data, sha)
        return web.json_response({"ok": True, "nbytes": len(data)})

    async def commit(self, request: web.Request) -> web.Response:
        manifest = Manifest.from_dict(parse_json(await request.read(), "the manifest"))
        if manifest.version != _int(request, "v"):
            raise ValueError(
                f"manifest version {manifest.version} != path version {request.match_info['v']}"
            )
        was = self.store.latest()
        self.store.commit(manifest)
        if self.store.latest() != was:
            self.counters.published += 1
            self._announce()
        return web.json_response({"ok": True, "version": manifest.version})

    async def latest(self, request: web.Request) -> web.Response:
        """The newest manifest, after waiting up to ``wait_s`` for one newer than
        (``after_generation``, ``after``); 204 when there is none."""
        after = (_query_int(request, "after_generation", -1), _query_int(request, "after", -1))
        raw_wait = request.query.get("wait_s", "0")
        try:
            wait_s = float(raw_wait)
        except ValueError:
            wait_s = math.nan
        if not 0 <= wait_s < math.inf:
            raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {raw_wait!r}")
        deadline = time.monotonic() + min(wait_s, 60.0)
        while True:
            latest = self.store.latest()
            if latest is not None and latest.key > after:
                self.store.lease(latest.version, time.monotonic() + self.settings.lease_s)
                return web.json_response(latest.to_dict())
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closing:
                return web.Response(status=204)
            event = self._new_version
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    async def get_bucket(self, request: web.Request) -> web.Response:
        v, i = _int(request, "v"), _int(request, "i")
        data = self.store.bucket(v, i)
        self.store.lease(v, time.monotonic() + self.settings.lease_s)
        return web.Response(
            body=data,
            content_type="application/octet-stream",
            headers={SHA_HEADER: self.store.manifest(v).buckets[i].sha256},
        )

    async def release(self, request: web.Request) -> web.Response:
        """A holder has no trajectory on an engine: it may be loaded (``--release-holders``).
        ``"version"``: the version the holder saw the engine serve; a release for another one
        (sent before a load finished) is refused with 409 and not counted. ``"detach": true``:
        the holder stopped, its release stands until it sends ``"attach": true`` (which releases
        nothing)."""
        body = parse_json(await request.read(), "the release")
        if not isinstance(body, dict):
            raise ValueError(f"a release must be a JSON object, got {type(body).__name__}")
        url, holder = str(body.get("engine", "")).rstrip("/"), body.get("holder")
        if url not in self.engines:
            return _error(404, f"engine {url!r} is not fed by this relay: {list(self.engines)}")
        if not isinstance(holder, str) or not holder:
            raise ValueError(f"holder must be a non-empty string, got {holder!r}")
        state = self.engines[url]
        seen = body.get("version")
        if seen is not None and seen != state.version:
            return _error(
                409,
                f"release of {url} by {holder} for version {seen!r}: the engine serves "
                f"{state.version} (loaded since); not counted",
            )
        if body.get("attach"):
            state.detached.discard(holder)
        else:
            state.released_by.add(holder)
            if body.get("detach"):
                state.detached.add(holder)
        self._released[url].set()
        return web.json_response(
            {
                "released": len(state.released_by),
                "holders": self.settings.release_holders,
                "version": state.version,
            }
        )

    def new_version_event(self) -> asyncio.Event:
        """Set when the next version is committed (each version replaces it)."""
        return self._new_version

    def _announce(self) -> None:
        """Wake every waiter (long polls, appliers) and collect what nobody needs."""
        self._wake()
        self.counters.collected += len(self.store.collect(time.monotonic()))

    def _wake(self) -> None:
        event, self._new_version = self._new_version, asyncio.Event()
        event.set()

    async def _end_long_polls(self, app: web.Application) -> None:
        """At shutdown, before aiohttp waits for the handlers: every long poll answers 204."""
        self._closing = True
        self._wake()

    # -- background tasks -----------------------------------------------------------------
    async def _start_tasks(self, app: web.Application) -> None:
        headers = (
            {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        )
        self._session = aiohttp.ClientSession(headers=headers)
        if self.settings.upstreams:
            self._tasks.append(asyncio.create_task(self._pull_loop(), name="relay-pull"))
        for url in self.engines:
            applier = EngineApplier(self, self.engines[url], self._released[url])
            self._tasks.append(asyncio.create_task(applier.run(), name=f"apply {url}"))
        self._tasks.append(asyncio.create_task(self._collect_loop(), name="relay-collect"))

    async def _stop_tasks(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _collect_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_s / 4)
            self.counters.collected += len(self.store.collect(time.monotonic()))

    # upstream ------------------------------------------------------------------------------
    async def _pull_loop(self) -> None:
        """Pull every newer version from the upstreams (the one that has the newest first)."""
        failures = 0
        while True:
            try:
                manifest, source = await self._newest_upstream()
                if manifest is not None:
                    await self._pull(manifest, source)
                    failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as err:  # an upstream down or a version that would not verify
                failures += 1
                log.warning("relay: pull failed (%s); retrying", err)
                await asyncio.sleep(backoff_s(self.settings, failures))

    async def _newest_upstream(self) -> tuple[Manifest | None, str]:
        """Long-poll every upstream at once; the first answer with a newer version wins (the
        others are cancelled). (None, "") when none had a newer one within the wait."""
        latest = self.store.latest()
        after = (-1, -1) if latest is None else latest.key
        polls = {
            asyncio.create_task(self._poll(url, after)): url for url in self.settings.upstreams
        }
        try:
            while polls:
                done, _ = await asyncio.wait(polls, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    url = polls.pop(task)
                    manifest = task.result()
                    if manifest is not None and manifest.key > after:
                        return manifest, url
            return None, ""
        finally:
            for task in polls:
                task.cancel()
            await asyncio.gather(*polls, return_exceptions=True)

    async def _poll(self, url: str, after: tuple[int, int]) -> Manifest | None:
        wait_s = self.settings.poll_wait_s
        try:
            async with self._session.get(
                f"{url}/versions/latest",
                params={
                    "after_generation": str(after[0]),
                    "after": str(after[1]),
                    "wait_s": str(wait_s),
                },
                timeout=aiohttp.ClientTimeout(total=wait_s + 10),
            ) as resp:
                if resp.status == 204:
                    return None
                if resp.status != 200:
                    raise EngineError(f"{url}/versions/latest: HTTP {resp.status}")
                return Manifest.from_dict(await resp.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, EngineError) as err:
            self.counters.upstream_errors += 1
            log.warning("relay: upstream %s: %s", url, err)
            await asyncio.sleep(min(wait_s, 1.0))  # a dead upstream does not spin the loop
            return None

    async def _pull(self, manifest: Manifest, source: str) -> None:
        """Fetch and verify every bucket of ``manifest`` (first from ``source``; a bucket that
        fails or does not verify is fetched again from the next upstream), then commit."""
        v = manifest.version
        order = [source, *(u for u in self.settings.upstreams if u != source)]
        self.store.begin(v, manifest.generation)
        for index, info in enumerate(manifest.buckets):
            for attempt in range(2 * len(order)):
                url = order[attempt % len(order)]
                if attempt:
                    self.counters.repulls += 1
                try:
                    data = await self._fetch(url, v, index)
                    self.store.put(v, index, data, info.sha256)
                    break
                except ChecksumError as err:
                    self.counters.checksum_refused += 1
                    log.warning(
                        "relay: refused bucket %d of version %d from %s: %s", index, v, url, err
                    )
                except (aiohttp.ClientError, asyncio.TimeoutError, EngineError) as err:
                    self.counters.upstream_errors += 1
                    log.warning("relay: bucket %d of version %d from %s: %s", index, v, url, err)
            else:
                self.store.abandon(v)
                raise EngineError(
                    f"no upstream of {list(order)} gave bucket {index} of version {v} with "
                    f"sha256 {info.sha256}"
                )
        self.store.commit(manifest)
        self.counters.pulled += 1
        self._announce()

    async def _fetch(self, url: str, version: int, index: int) -> bytes:
        async with self._session.get(
            f"{url}/versions/{version}/buckets/{index}",
            timeout=aiohttp.ClientTimeout(total=600, sock_connect=5),
        ) as resp:
            if resp.status != 200:
                raise EngineError(f"{url}: bucket {index} of version {version}: HTTP {resp.status}")
            return await resp.read()


def _int(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _query_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r:.80}") from None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-earl relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", default="", help="relays to pull from, comma-separated")
    p.add_argument("--engines", default="", help="engine URLs this relay feeds, comma-separated")
    p.add_argument(
        "--pause-mode", default=str(PauseMode.RETRACT), choices=[str(m) for m in PauseMode]
    )
    p.add_argument(
        "--engine-tp",
        type=int,
        default=None,
        help="TP size of each engine (default: each engine's own, from /get_server_info)",
    )
    p.add_argument("--lease-s", type=float, default=60.0)
    p.add_argument("--poll-wait-s", type=float, default=10.0)
    p.add_argument("--engine-check-s", type=float, default=2.0)
    p.add_argument("--max-bucket-mb", type=int, default=2048)
    p.add_argument(
        "--max-clock-skew-s",
        type=float,
        default=RelaySettings.max_clock_skew_s,
        help="a publisher's generation (its start time) may be this far ahead of this relay's "
        "clock at most",
    )
    p.add_argument(
        "--allow-no-key",
        action="store_true",
        help=f"serve without ${API_KEY_ENV} on an address other than loopback (a trusted "
        "network): anything that reaches the relay may publish weights",
    )
    p.add_argument(
        "--release-holders",
        type=int,
        default=0,
        help="load an engine only after this many holders released it (rollout.repack: the "
        "trainer's process count); 0: load at once",
    )
    p.add_argument(
        "--verify-tensors",
        type=int,
        default=RelaySettings.verify_tensors,
        help="tensors read back from an engine after each load (get_weights_by_name) and "
        "compared with the published values; 0: off",
    )
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> RelaySettings:
    def urls(raw: str) -> tuple[str, ...]:
        return tuple(u.strip().rstrip("/") for u in raw.split(",") if u.strip())

    return RelaySettings(
        upstreams=urls(args.upstream),
        engines=urls(args.engines),
        pause_mode=args.pause_mode,
        engine_tp=args.engine_tp,
        lease_s=args.lease_s,
        poll_wait_s=args.poll_wait_s,
        engine_check_s=args.engine_check_s,
        max_bucket_bytes=args.max_bucket_mb << 20,
        release_holders=args.release_holders,
        verify_tensors=args.verify_tensors,
        api_key=os.environ.get(API_KEY_ENV) or None,
        max_clock_skew_s=args.max_clock_skew_s,
    )


def exposure_problem(host: str, api_key: str | None, allow_no_key: bool) -> str | None:
    """Why a relay may not serve on ``host`` (None when it may): an address other than loopback
    needs a key unless the network is declared trusted."""
    if api_key or allow_no_key or _is_loopback(host):
        return None
    return (
        f"--host {host} is reachable from other machines and ${API_KEY_ENV} is not set: anything "
        f"that reaches the relay could publish weights; set ${API_KEY_ENV} here and on the "
        "trainer, bind to 127.0.0.1, or pass --allow-no-key for a trusted network"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any address


async def _serve(args: argparse.Namespace) -> None:
    server = RelayServer(settings_from_args(args))
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.warning("relay listening on http://%s:%d", args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as err:
        print(f"megatron-earl relay: {err}")
        return 2
    if (problem := exposure_problem(args.host, settings.api_key, args.allow_no_key)) is not None:
        print(f"megatron-earl relay: {problem}")
        return 2
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    from megatron_earl.compat.processes import skip_exit_gc

    skip_exit_gc()
    raise SystemExit(main())


__all__ = ["RelayServer", "RelaySettings", "digest", "main"]
