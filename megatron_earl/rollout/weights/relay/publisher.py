"""The trainer's side of the relay weight service: publish a version once, to one root relay.

    publisher = RelayPublisher(["http://relay0:31000", "http://relay1:31000"])
    stats = await publisher.publish(named_tensors, version=7, bucket_bytes=512 << 20)

The tensors are encoded bucket by bucket (``codec``) and uploaded while the next bucket is
encoded; the manifest (every bucket's checksum, size and tensor count) commits the version. The
trainer's cost is one copy of the weights to one relay, whatever the number of engines: the
relays fan out (``server``). A root that fails mid-publish leaves nothing visible (its staged
buckets are never served); the whole version is published again to the next root of the list,
which the other relays also pull from (``--upstream`` lists every root).

``RelayTransport`` is the ``rollout.sglang.weight_update: relay`` transport: in the synchronous
loop the push waits until every engine reports the version (the rollout needs it); in the
asynchronous loop it returns once a root relay committed the version, and each engine takes it
when its relay gets to it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence

import aiohttp

from megatron_earl.rollout.engine import EngineError
from megatron_earl.rollout.sglang.client import SGLangClient
from megatron_earl.rollout.weights.relay.codec import NamedTensor, encode_bucket
from megatron_earl.rollout.weights.relay.versions import BucketInfo, Manifest, digest
from megatron_earl.rollout.weights.relay.wire import SHA_HEADER, auth_headers
from megatron_earl.rollout.weights.sync import PushStats, iter_buckets


class RelayPublisher:
    """Publishes versions to the first root relay that takes them (module docstring)."""

    def __init__(self, roots: Sequence[str], timeout_s: float = 600.0) -> None:
        if not roots:
            raise ValueError("a relay publisher needs at least one root relay URL")
        self.roots = [u.rstrip("/") for u in roots]
        self.timeout_s = timeout_s
        self.failovers = 0
        """Publishes that moved to another root after a failure."""
        self.generation = time.time_ns() // 1_000_000
        """This publisher's generation (``versions``): its start in ms since the epoch, so a
        trainer resumed later publishes in a newer one."""

    async def publish(
        self, named: Iterable[NamedTensor], version: int, bucket_bytes: int
    ) -> PushStats:
        """Publish ``named`` as ``version``; ``EngineError`` naming every root when none took
        it. The tensors are read once (encoded buckets are kept for a retry on another root)."""
        start = time.perf_counter()
        encoded: list[tuple[bytes, int]] = []
        """(bytes, tensor count) of the buckets encoded so far (reused on another root)."""
        source = iter(iter_buckets(named, bucket_bytes))
        errors = []
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=5)
        async with aiohttp.ClientSession(headers=auth_headers(), timeout=timeout) as session:
            for attempt, root in enumerate(self.roots):
                if attempt:
                    self.failovers += 1
                try:
                    infos = await self._publish_to(session, root, version, source, encoded)
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError, EngineError) as err:
                    errors.append(f"{root}: {err}")
            else:
                raise EngineError(f"no root relay took weight version {version}: {errors}")
        nbytes = sum(i.nbytes for i in infos)
        return PushStats(
            len(infos), sum(i.tensors for i in infos), nbytes, time.perf_counter() - start
        )

    async def _publish_to(self, session, root, version, source, encoded) -> list[BucketInfo]:
        """begin, every bucket (encoding the next while the last uploads), commit."""
        params = {"generation": str(self.generation)}
        await _ok(session.post(f"{root}/versions/{version}/begin", params=params))
        infos: list[BucketInfo] = []
        upload: asyncio.Task | None = None
        while True:
            index = len(infos)
            if index == len(encoded):
                bucket = next(source, None)
                if bucket is None:
                    break
                data = await asyncio.to_thread(encode_bucket, bucket)  # overlaps the upload
                encoded.append((data, len(bucket)))
            data, count = encoded[index]
            if upload is not None:
                await upload
            sha = digest(data)
            infos.append(BucketInfo(sha, len(data), count))
            upload = asyncio.create_task(
                _ok(
                    session.put(
                        f"{root}/versions/{version}/buckets/{index}",
                        data=data,
                        headers={SHA_HEADER: sha, "Content-Type": "application/octet-stream"},
                    )
                )
            )
        if upload is not None:
            await upload
        manifest = Manifest(version, tuple(infos), self.generation)
        await _ok(session.post(f"{root}/versions/{version}/commit", json=manifest.to_dict()))
        return infos


async def _ok(request) -> None:
    async with request as resp:
        if resp.status != 200:
            raise EngineError(
                f"{resp.method} {resp.url.path}: HTTP {resp.status}: {(await resp.text())[:300]}"
            )


async def wait_for_engines(
    clients: Sequence[SGLangClient], version: int, timeout_s: float, poll_s: float = 0.05
) -> float:
    """Wait until every engine reports ``version``; returns the seconds waited. ``EngineError``
    names the engines still on another version at the timeout."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    pending = list(clients)
    while pending:
        results = await asyncio.gather(
            *(c.get_model_info() for c in pending), return_exceptions=True
        )
        pending = [
            c
            for c, r in zip(pending, results)
            if isinstance(r, BaseException) or c.weight_version != version
        ]
        if not pending:
            break
        if time.monotonic() > deadline:
            raise EngineError(
                f"after publishing weight version {version} to the relays, engines "
                f"{ {c.base_url: c.weight_version for c in pending} } did not report it within "
                f"{timeout_s:.0f}s (see each relay's /relay_info)"
            )
        await asyncio.sleep(poll_s)
    return time.perf_counter() - start
