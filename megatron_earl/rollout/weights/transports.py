"""Weight transports from the trainer to SGLang engines, one class per SGLang protocol, chosen
once by ``rollout.sglang.weight_update`` (``config.sglang``). The same ``SGLangClient`` calls
drive a real SGLang server (GPU) and ``megatron-earl serve`` (CPU, CI).

    transport = build_transport(settings, model_config, run_dir)   # on the trainer's rank 0
    stats = asyncio.run(transport.push(clients, full, version))    # every step the engines lag
    asyncio.run(transport.close(clients))                          # end of the run

Every push follows SGLang users' order: ``pause_generation`` -> ``flush_cache`` ->
``begin_weight_update`` -> the update (its last bucket also flushes the prefix cache, but with
``pause_mode: in_place``) -> ``end_weight_update`` -> ``continue_generation`` (``weights.sync``;
the disk protocol opens no session); then each engine's weight version is read back
(``get_model_info``) and must be the pushed one (``EngineError`` naming the engine otherwise).

- ``tensor``: ``update_weights_from_tensor`` per bucket (``weights.sync.push_weights``), in the
  payload format of ``tensor_payload`` / ``tensor_load_format``
  (``rollout.weights.tensor_payload``): portable (serve only, any host) or SGLang's own (real
  SGLang and serve; colocated only).
- ``disk``: the HF directory ``<weight_dir>/v<version>`` written by the streaming exporter
  (``convert.export_hf``), then ``update_weights_from_disk`` on every engine; the previous
  version's directory is removed once the engines serve the new one. The engines must see the
  directory at the same path and be allowed to read it (serve: ``--weight-dirs``).
- ``distributed``: at the first push the trainer's rank 0 joins a process group with every
  engine (``init_weights_update_group``; engine i's ranks start at ``1 + i * engine_tp``), then
  per bucket ``update_weights_from_distributed`` while rank 0 broadcasts the tensors
  (``weights.group.broadcast_bucket``). The group lives until ``close``.

- ``relay``: published once to a root relay (``relay.publisher``); the relays fan it out and
  load it into their engines on their own (``relay.server``). Synchronous loop: the push waits
  until every engine reports the version; asynchronous (``asynchronous`` set): it returns once
  the version is committed on a root relay (the trainer's stall is one copy to one relay).

``PushStats.bytes_sent`` is the tensor bytes each engine receives (disk: bytes written once).
Which ranks call: only the rank that holds the full tensors (rank 0).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import shutil
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlparse

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.config.vocab import WeightUpdate
from megatron_earl.rollout.engine import EngineError
from megatron_earl.rollout.sglang.client import SGLangClient
from megatron_earl.rollout.sglang.identity import engine_tp_size
from megatron_earl.rollout.weights.group import (
    FLATTENED,
    broadcast_bucket,
    host_group_store,
    join_weight_update_group,
)
from megatron_earl.rollout.weights.relay.publisher import RelayPublisher, wait_for_engines
from megatron_earl.rollout.weights.sync import (
    NamedTensor,
    PushStats,
    WeightSyncConfig,
    in_daemon_thread,
    paused,
    push_weights,
    push_weights_distributed,
)
from megatron_earl.rollout.weights.tensor_payload import TensorPayloadFormat

GROUP_NAME = "megatron_earl_weights"


class WeightTransport(ABC):
    """One way of moving the trainer's weights into SGLang engines (module docstring)."""

    kind: ClassVar[WeightUpdate]

    def __init__(self, settings: SGLangConfig, model: ModelConfig, run_dir: Path) -> None:
        self.settings = settings
        self.model = model
        self.run_dir = run_dir
        self.asynchronous = False
        """Set by the asynchronous loop: generation goes on during pushes."""
        self.sync = WeightSyncConfig(
            bucket_bytes=settings.bucket_bytes, pause_mode=settings.pause_mode
        )
        self._engine_tp: int | None = None
        self.hf_config: dict = {}
        """``config.json`` fields of the HF directories the disk protocol writes (the
        tokenizer's token ids: ``convert.engine_model.token_ids_config``)."""

    @property
    def staging_device(self) -> torch.device | None:
        """Where the trainer stages the buckets it pushes: None for host memory (tensors that
        leave over HTTP or to files), a device for a transport that sends from it."""
        return None

    async def engine_tp(self, clients: Sequence[SGLangClient]) -> int:
        """The engines' TP size: ``rollout.sglang.engine_tp`` when set (the trainer's start-up
        check compared it with the engines'), else read from the engines once
        (``/get_server_info``'s ``tp_size``; engines that disagree are an ``EngineError``)."""
        if self.settings.engine_tp is not None:
            return self.settings.engine_tp
        if self._engine_tp is None:
            infos = await asyncio.gather(*(c.get_server_info() for c in clients))
            sizes = {c.base_url: engine_tp_size(i) for c, i in zip(clients, infos)}
            if len(set(sizes.values())) > 1:
                raise EngineError(f"the engines' TP sizes differ: {sizes}")
            self._engine_tp = next(iter(sizes.values()), 1)
        return self._engine_tp

    async def push(
        self, clients: Sequence[SGLangClient], named: Iterable[NamedTensor], version: int
    ) -> PushStats:
        """Push ``named`` (HF names) to every engine as ``version``; checks the version each
        engine reports afterwards."""
        stats = await self._push(clients, named, version)
        await check_versions(clients, version)
        return stats

    @abstractmethod
    async def _push(
        self, clients: Sequence[SGLangClient], named: Iterable[NamedTensor], version: int
    ) -> PushStats: ...

    async def close(self, clients: Sequence[SGLangClient]) -> None:  # noqa: B027 (optional)
        """Release what the transport holds on the engines and here (end of the run)."""


TRANSPORTS: dict[WeightUpdate, type[WeightTransport]] = {}


def register_transport(cls: type[WeightTransport]) -> type[WeightTransport]:
    TRANSPORTS[cls.kind] = cls
    return cls


def build_transport(settings: SGLangConfig, model: ModelConfig, run_dir: Path) -> WeightTransport:
    return TRANSPORTS[WeightUpdate(settings.weight_update)](settings, model, run_dir)


async def check_versions(clients: Sequence[SGLangClient], version: int) -> None:
    """Read every engine's weight version back; ``EngineError`` names one that differs."""
    await asyncio.gather(*(c.get_model_info() for c in clients))
    wrong = {c.base_url: c.weight_version for c in clients if c.weight_version != version}
    if wrong:
        raise EngineError(f"after pushing weight version {version}, engines report {wrong}")


@register_transport
class TensorTransport(WeightTransport):
    kind = WeightUpdate.TENSOR

    def __init__(self, settings: SGLangConfig, model: ModelConfig, run_dir: Path) -> None:
        super().__init__(settings, model, run_dir)
        load_format = FLATTENED if settings.tensor_load_format == FLATTENED else None
        self.payload = TensorPayloadFormat(settings.tensor_payload, load_format)

    async def _push(self, clients, named, version):
        return await push_weights(
            clients,
            named,
            version,
            self.sync,
            payload=self.payload,
            engine_tp=await self.engine_tp(clients),
        )


@register_transport
class DiskTransport(WeightTransport):
    kind = WeightUpdate.DISK

    def __init__(self, settings: SGLangConfig, model: ModelConfig, run_dir: Path) -> None:
        super().__init__(settings, model, run_dir)
        self.dir = Path(settings.weight_dir or run_dir / "engine_weights").resolve()
        self.current: Path | None = None

    async def _push(self, clients, named, version):
        from megatron_earl.convert.convert import export_hf

        start = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        out = self.dir / f"v{version}"
        if out.exists():  # a push of this version that did not complete (e.g. resumed run)
            shutil.rmtree(out)
        written = await asyncio.to_thread(
            functools.partial(export_hf, base_config=self.hf_config), named, self.model, out
        )
        async with paused(clients, self.sync):
            await asyncio.gather(
                *(c.update_weights_from_disk(str(out), weight_version=version) for c in clients)
            )
        previous, self.current = self.current, out
        if previous is not None and previous != out:
            shutil.rmtree(previous, ignore_errors=True)
        return PushStats(1, 0, written, time.perf_counter() - start)

    async def close(self, clients: Sequence[SGLangClient]) -> None:
        """The last version's directory stays (engines may restart from it)."""


@register_transport
class DistributedTransport(WeightTransport):
    kind = WeightUpdate.DISTRIBUTED

    def __init__(self, settings: SGLangConfig, model: ModelConfig, run_dir: Path) -> None:
        super().__init__(settings, model, run_dir)
        self.group = None
        self.backend = settings.group_backend or (
            "nccl" if torch.cuda.is_available() and _computes_on_cuda() else "gloo"
        )
        self.load_format = FLATTENED if settings.distributed_load_format == FLATTENED else None

    @property
    def staging_device(self) -> torch.device | None:
        """NCCL broadcasts from the GPU: the buckets are staged there, not on the host."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None

    async def _join(self, clients: Sequence[SGLangClient]) -> None:
        """Rank 0 of the group here, engine i's TP ranks from ``1 + i * engine_tp``; all join
        concurrently (the engines' HTTP calls return once the group stands)."""
        s = self.settings
        urls = [c.base_url for c in clients]
        address = s.group_address or group_address(urls)
        tp = await self.engine_tp(clients)
        world = 1 + len(clients) * tp
        # Without a configured port the store is bound first and its port sent: nothing can
        # take the port between the pick and the bind.
        store = None if s.group_port else host_group_store(address, world, s.group_timeout_s)
        port = s.group_port or store.port
        joins = [
            c.init_weights_update_group(
                address,
                port,
                1 + i * tp,
                world,
                GROUP_NAME,
                self.backend,
                timeout_s=s.group_timeout_s,
            )
            for i, c in enumerate(clients)
        ]
        local = in_daemon_thread(
            join_weight_update_group,
            address,
            port,
            0,
            world,
            GROUP_NAME,
            self.backend,
            s.group_timeout_s,
            store,
        )
        results = await asyncio.gather(local, *joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            store = None  # closed now, not with the traceback: the engines' waits end at once
            raise EngineError(
                f"cannot form weight-update group {GROUP_NAME!r} at {address}:{port} with "
                f"{urls}: {errors[0]}"
            ) from errors[0]
        self.group = results[0]

    async def _push(self, clients, named, version):
        if self.group is None:
            await self._join(clients)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        )

        def send(bucket: list[NamedTensor]) -> None:
            if device is not None:
                bucket = [(n, t.to(device, non_blocking=True)) for n, t in bucket]
            broadcast_bucket(self.group, bucket, self.load_format)

        return await push_weights_distributed(
            clients,
            named,
            version,
            send,
            self.sync,
            group_name=GROUP_NAME,
            load_format=self.load_format,
            timeout_s=self.settings.group_timeout_s,
        )

    async def close(self, clients: Sequence[SGLangClient]) -> None:
        """Destroy the group on the engines (errors ignored: an engine may be gone) and here."""
        if self.group is None:
            return
        await asyncio.gather(
            *(c.destroy_weights_update_group(GROUP_NAME) for c in clients),
            return_exceptions=True,
        )
        self.group.shutdown()
        self.group = None


@register_transport
class RelayTransport(WeightTransport):
    kind = WeightUpdate.RELAY

    def __init__(self, settings: SGLangConfig, model: ModelConfig, run_dir: Path) -> None:
        super().__init__(settings, model, run_dir)
        self.publisher = RelayPublisher(settings.relay_urls, settings.relay_timeout_s)
        self.published = False

    async def push(self, clients, named, version):
        """Publish; then wait until every engine reports ``version`` in the synchronous loop,
        and at the first push of the asynchronous one (no request runs on weights the run
        never had)."""
        stats = await self._push(clients, named, version)
        if not self.asynchronous or not self.published:
            await wait_for_engines(clients, version, self.settings.relay_timeout_s)
        self.published = True
        return stats

    async def _push(self, clients, named, version):
        return await self.publisher.publish(named, version, self.settings.bucket_bytes)


def _computes_on_cuda() -> bool:
    from megatron_earl import runtime

    return runtime.device().type == "cuda"


def group_address(urls: Sequence[str]) -> str:
    """127.0.0.1 when every engine is on loopback, else this host's address on the route to the
    first engine (what it can connect back to)."""
    hosts = [urlparse(u).hostname or "" for u in urls]
    if all(h == "localhost" or _is_loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((hosts[0], 9))  # no packet is sent; picks the outgoing interface
        return s.getsockname()[0]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
