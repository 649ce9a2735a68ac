"""A relay's engine appliers: each keeps one engine on the relay's newest weight version
(``relay/server.py``'s docstring, "Engines" and "Loading on release", says what they do).

    applier = EngineApplier(relay, EngineState(url), released=asyncio.Event())
    task = asyncio.create_task(applier.run())     # until cancelled

``relay`` is what an applier reads of its relay (``Relay``, which ``RelayServer`` is):
``settings``, ``store``, ``counters`` and ``new_version_event()`` (set when a newer version is
committed).
``may_load`` is the release rule (pure); ``backoff_s`` the retry delay after failures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_earl.config.vocab import TensorPayload
from megatron_earl.rollout.engine import EngineError
from megatron_earl.rollout.sglang.client import ClientConfig, EngineRequestError, SGLangClient
from megatron_earl.rollout.sglang.identity import SERVE_ENGINE
from megatron_earl.rollout.weights.relay.codec import decode_bucket
from megatron_earl.rollout.weights.relay.readback import (
    SGLANG_NO_EXPORT,
    VERIFY_ROWS,
    read_back_matches,
    sampled_buckets,
)
from megatron_earl.rollout.weights.relay.settings import Counters, RelaySettings
from megatron_earl.rollout.weights.relay.versions import VersionStore
from megatron_earl.rollout.weights.sync import WeightSyncConfig, push_weights
from megatron_earl.rollout.weights.tensor_payload import TensorPayloadFormat

log = logging.getLogger("megatron_earl.rollout.weights.relay")


class Relay(Protocol):
    """What an applier reads of its relay (``server.RelayServer``)."""

    settings: RelaySettings
    store: VersionStore
    """The versions held (the applier loads the newest)."""
    counters: Counters
    """The relay's counters (the applier counts read-back mismatches and skips)."""

    def new_version_event(self) -> asyncio.Event:
        """An event set when a newer version is committed."""
        ...


@dataclass
class EngineState:
    """What one applier knows of its engine."""

    url: str
    version: int | None = None
    """Version the engine last reported (None: not reached yet)."""
    healthy: bool = False
    applies: int = 0
    failures: int = 0
    last_error: str = ""
    last_apply_s: float = 0.0
    loaded: int | None = None
    """Version this relay last loaded into it (another reported version: a restart)."""
    released_by: set[str] = field(default_factory=set)
    """Holders that released it since its last load (``--release-holders``)."""
    detached: set[str] = field(default_factory=set)
    """Holders that stopped (their release stands for every later version until they attach
    again)."""
    mismatches: int = 0
    """Loads whose read-back differed from the published values (loaded again)."""
    unverified: int | None = None
    """A version the engine reports but whose read-back did not match: not taken as reached,
    loaded again."""
    tp_size: int | None = None
    """The engine's TP size (read before its first load)."""
    payload: str | None = None
    """The tensor payload it reads: ``sglang`` for SGLang (same host: a relay feeds the engines
    of its node), ``portable`` for ``megatron-earl serve``."""

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["released_by"] = sorted(self.released_by)
        out["detached"] = sorted(self.detached)
        return out


def may_load(state: EngineState, holders: int) -> bool:
    """``--release-holders``: every holder released the engine since its last load, or the
    engine serves another version than the one it served when this relay first reached it
    or last loaded it (an engine restart, or a load whose read-back failed: loaded again
    without a release). ``holders`` 0: always. Pure."""
    if holders == 0 or state.loaded is None or state.version != state.loaded:
        return True
    return len(state.released_by | state.detached) >= holders


def backoff_s(settings: RelaySettings, failures: int) -> float:
    """Delay before the next try after ``failures`` failures in a row: doubling from
    ``retry_s`` up to ``retry_max_s``, jittered by +-25%."""
    return min(settings.retry_s * 2 ** (failures - 1), settings.retry_max_s) * random.uniform(
        0.75, 1.25
    )


class EngineApplier:
    """Keeps one engine on its relay's newest version (module docstring)."""

    def __init__(self, relay: Relay, state: EngineState, released: asyncio.Event) -> None:
        self.relay = relay
        self.settings = relay.settings
        self.state = state
        self.released = released
        """Set by the relay when a holder releases this engine (``POST /engines/release``)."""

    async def run(self) -> None:
        """Keep the engine on the newest version (module docstring); until cancelled."""
        url, state = self.state.url, self.state
        key = os.environ.get("SGLANG_ADMIN_API_KEY") or os.environ.get("SGLANG_API_KEY") or None
        client = SGLangClient(url, ClientConfig(api_key=key, max_retries=1, connect_timeout_s=3))
        failures = 0
        resumed = False
        try:
            while True:
                event = self.relay.new_version_event()
                try:
                    await client.get_model_info()
                    state.version, state.healthy = client.weight_version, True
                    if not resumed:  # a relay killed mid-apply left it paused: continue it
                        await client.resume()
                        resumed = True
                        if state.loaded is None and state.version >= 0:
                            # what it serves counts as loaded: a restarted relay does not load
                            # an engine that still holds trajectories without its release
                            state.loaded = state.version
                    newest = self.relay.store.newest_version()
                    behind = state.version != newest or state.unverified == newest
                    if (
                        newest is not None
                        and behind
                        and may_load(state, self.settings.release_holders)
                    ):
                        await self._apply(client, state, newest)
                        failures = 0
                        continue  # a newer version may have come in meanwhile
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # this engine only: others go on
                    failures += 1
                    state.healthy, state.failures = False, state.failures + 1
                    state.last_error = str(err)[:500]
                    log.warning("relay: engine %s: %s", url, err)
                    await asyncio.sleep(backoff_s(self.settings, failures))
                    continue
                released = self.released
                waits = [asyncio.ensure_future(e.wait()) for e in (event, released)]
                await asyncio.wait(
                    waits, timeout=self.settings.engine_check_s, return_when="FIRST_COMPLETED"
                )
                for w in waits:
                    w.cancel()
                released.clear()
        finally:
            await client.close()

    async def _apply(self, client: SGLangClient, state: EngineState, version: int) -> None:
        start = time.perf_counter()
        with self.relay.store.pinned(version):
            manifest = self.relay.store.manifest(version)
            sampled = sampled_buckets(len(manifest.buckets), self.settings.verify_tensors)
            samples: dict[str, torch.Tensor] = {}  # the published first rows, to read back

            def named() -> Iterator[tuple[str, torch.Tensor]]:
                for i in range(len(manifest.buckets)):
                    pairs = decode_bucket(self.relay.store.bucket(version, i))
                    if i in sampled:  # its smallest tensor (see readback: SGLang's cost)
                        name, tensor = min(pairs, key=lambda pair: pair[1].numel())
                        samples[name] = tensor[:VERIFY_ROWS].clone()
                    yield from pairs

            sync = WeightSyncConfig(
                bucket_bytes=max(b.nbytes for b in manifest.buckets),
                pause_mode=self.settings.pause_mode,
                flush_cache=False,
            )
            await self._read_engine(client, state)
            payload = TensorPayloadFormat(state.payload)
            await push_weights([client], named(), version, sync, payload=payload,
                               engine_tp=state.tp_size)  # fmt: skip
        await client.get_model_info()
        if client.weight_version != version:
            raise EngineError(
                f"engine {client.base_url} reports version {client.weight_version} after "
                f"loading version {version}"
            )
        await self._read_back(client, state, version, samples)
        state.version, state.applies, state.unverified = version, state.applies + 1, None
        state.loaded = version
        state.released_by.clear()
        state.last_apply_s = time.perf_counter() - start

    async def _read_engine(self, client: SGLangClient, state: EngineState) -> None:
        """The engine's TP size and the payload it reads (``/get_server_info``), once."""
        if state.tp_size is not None:
            return
        try:
            info = await client.get_server_info()
        except EngineRequestError as err:
            if err.status != 404:
                raise
            info = {}  # not SGLang (which always answers it): one rank, the portable payload
        tp = int(info.get("tp_size") or self.settings.engine_tp or 1)
        if self.settings.engine_tp is not None and tp != self.settings.engine_tp:
            raise EngineError(
                f"engine {client.base_url} runs with tp_size={tp}, this relay's --engine-tp is "
                f"{self.settings.engine_tp}"
            )
        serve = info.get("engine") == SERVE_ENGINE or not info
        kind = TensorPayload.PORTABLE if serve else TensorPayload.SGLANG
        state.tp_size, state.payload = tp, str(kind)

    async def _read_back(
        self,
        client: SGLangClient,
        state: EngineState,
        version: int,
        samples: dict[str, torch.Tensor],
    ) -> None:
        """Read ``samples`` back from the engine (``get_weights_by_name``) and compare them with
        the published values (``readback``). A difference is counted and raised: the engine is
        not taken as serving ``version`` (``state.unverified``) and is loaded again after the
        backoff. An engine that cannot read weights back is counted and not checked."""
        for name, want in samples.items():
            try:
                got = await client.get_weights_by_name(name, len(want))
            except EngineRequestError as err:
                if err.status == 404 or (err.status == 400 and SGLANG_NO_EXPORT in str(err)):
                    self.relay.counters.engine_check_unsupported += 1
                    log.warning(
                        "relay: engine %s cannot read weights back (%s): version %d not checked",
                        client.base_url,
                        err,
                        version,
                    )
                    return
                raise
            if not read_back_matches(got, want):
                self.relay.counters.engine_mismatches += 1
                state.mismatches, state.unverified = state.mismatches + 1, version
                raise EngineError(  # logged by the applier, naming the engine
                    f"{name} read back after loading version {version} differs from the "
                    "published values (engine_mismatches): loading it again"
                )
