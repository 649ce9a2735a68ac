"""Weight push from the trainer to SGLang engines, in buckets, with a weight version.

    full = ...                                        # global Megatron tensors (e.g. resharded)
    named = hf_named_tensors(full, model_config)      # lazily converted to HF names
    stats = await push_weights(clients, named, version=7, config=WeightSyncConfig())

Order (what RL trainers do with SGLang): ``pause_generation`` -> ``flush_cache`` ->
``begin_weight_update`` -> buckets -> ``end_weight_update`` -> ``continue_generation`` (the
session pair is SGLang's, which 0.5.23 requires around tensor and distributed updates; a server
that answers 404 to it predates sessions and gets none). The last bucket carries the new
``weight_version`` so a server reports the new version only once every tensor arrived. Each
bucket holds at most ``bucket_bytes`` of tensors (a tensor larger than a bucket travels alone)
and is sent to all engines concurrently.

Transports (one function each):
* ``tensor``: ``/update_weights_from_tensor`` with ``serialized_named_tensors`` = one base64
  payload per engine TP rank, in the format of ``payload`` (``tensor_payload``): portable
  (``torch.save`` of (HF name, tensor) pairs; ``megatron-earl serve`` only) or SGLang's
  ``MultiprocessingSerializer`` format (handles, colocated engines only; what a real SGLang
  server reads, and serve too), with ``load_format`` None or "flattened_bucket".
* ``distributed``: ``/init_weights_update_group`` once, then per bucket
  ``/update_weights_from_distributed`` (names, dtypes, shapes) while the trainer rank broadcasts
  the tensors over that group (``weights.group.broadcast_bucket``); NCCL in production.

``rollout.weights.transports`` picks one of these per run (``rollout.sglang.weight_update``) and
adds the disk protocol.

To the embedded engine no push is needed: weights are resharded into ``engine.model_chunks``
(``redistribute.weight_exec``) and ``engine.mark_weights_updated(version)`` records the version.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import PauseMode
from megatron_earl.models.hf_mapping import megatron_to_hf
from megatron_earl.rollout.weights.tensor_payload import TensorPayloadFormat
from megatron_earl.rollout.weights.tensor_payload import (  # noqa: F401 (names callers import from here)
    decode_payload as deserialize_named_tensors,
)
from megatron_earl.rollout.weights.tensor_payload import (  # noqa: F401
    serialize_portable as serialize_named_tensors,
)

NamedTensor = tuple[str, torch.Tensor]
T = TypeVar("T")


@dataclass(frozen=True)
class WeightSyncConfig:
    """How weights travel to SGLang engines."""

    bucket_bytes: int = 512 << 20
    """Payload bytes per bucket at most (a larger single tensor is sent alone)."""
    pause_mode: str = "retract"
    """``pause_generation`` mode: "retract" re-prefills running requests with the new weights,
    "in_place" keeps their KV cache, "abort" aborts them."""
    flush_cache: bool = True
    """Flush the prefix cache before pushing (cached prefixes were computed by old weights)."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.pause_mode not in tuple(PauseMode):
            raise ValueError(
                f"pause_mode {self.pause_mode!r} is not one of {[str(m) for m in PauseMode]}"
            )


@dataclass(frozen=True)
class PushStats:
    """What one push did."""

    num_buckets: int
    num_tensors: int
    bytes_sent: int
    """Payload bytes per engine."""
    seconds: float


def hf_named_tensors(full: Mapping[str, torch.Tensor], model: ModelConfig) -> Iterator[NamedTensor]:
    """HF-named tensors of a full Megatron state, converted one key at a time."""
    for key, tensor in full.items():
        yield from megatron_to_hf(key, tensor, model)


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Greedy, order-preserving grouping of tensor indices into buckets of <= ``bucket_bytes``."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes):
        if current and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def iter_buckets(named: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Stream ``named`` into buckets (same rule as ``plan_buckets``) without materialising all."""
    current: list[NamedTensor] = []
    filled = 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        if current and filled + size > bucket_bytes:
            yield current
            current, filled = [], 0
        current.append((name, tensor))
        filled += size
    if current:
        yield current


def marked_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last, reading one item ahead: a stream of buckets is
    pushed with at most two of them alive (the one sent and the next)."""
    source = iter(items)
    try:
        current = next(source)
    except StopIteration:
        return
    for following in source:
        yield current, False
        current = following
    yield current, True


def flushes_after(config: WeightSyncConfig) -> bool:
    """Whether the last bucket asks the engine to flush its prefix cache once the new weights are
    in (SGLang's ``flush_cache`` field of the update): always, but with ``pause_mode: in_place``,
    whose running requests keep their KV on purpose (SGLang refuses the flush then). A paused
    SGLang flushes with retracted requests waiting; without it the prefixes cached under the old
    weights (every prompt's chat-template head) would be reused after the update, which the
    flush before the update cannot prevent when requests were in flight (the asynchronous loop,
    relays)."""
    return config.pause_mode != PauseMode.IN_PLACE


@contextlib.asynccontextmanager
async def paused(
    clients: Sequence, config: WeightSyncConfig, *, session: bool = False
) -> AsyncIterator[None]:
    """The push order RL trainers use: pause -> flush (optional) -> body -> continue (always).

    ``session``: the body runs inside SGLang's weight-update session, opened after the flush
    and closed before generation continues (``begin_weight_update`` / ``end_weight_update``;
    SGLang 0.5.23 refuses tensor and distributed updates outside one). The session is closed
    even when the body fails (a failure to close then does not hide the body's error)."""
    await asyncio.gather(*(c.pause(config.pause_mode) for c in clients))
    try:
        if config.flush_cache:
            await asyncio.gather(*(c.flush_cache() for c in clients))
        if not session:
            yield
            return
        opened = await asyncio.gather(
            *(c.begin_weight_update() for c in clients), return_exceptions=True
        )
        try:
            if errors := [e for e in opened if isinstance(e, BaseException)]:
                raise errors[0]
            yield
        except BaseException:
            await asyncio.gather(
                *(c.end_weight_update() for c, e in zip(clients, opened) if e is None),
                return_exceptions=True,
            )
            raise
        await asyncio.gather(*(c.end_weight_update() for c in clients))
    finally:
        await asyncio.gather(*(c.resume() for c in clients))


async def push_weights(
    clients: Sequence,
    named: Iterable[NamedTensor],
    version: int,
    config: WeightSyncConfig | None = None,
    *,
    payload: TensorPayloadFormat | None = None,
    engine_tp: int = 1,
) -> PushStats:
    """Push ``named`` tensors to every client (``SGLangClient``) by ``update_weights_from_tensor``.

    ``engine_tp`` payloads per bucket and engine (SGLang wants one per engine TP rank; each rank
    takes the whole tensors it needs), in ``payload``'s format (default: portable); an sglang
    payload is serialized once per engine rank (each opens its handles once). Runs on the one
    trainer process that holds the full tensors.
    """
    config = config or WeightSyncConfig()
    payload = payload or TensorPayloadFormat()
    start = time.perf_counter()
    async with paused(clients, config, session=True):
        sent = tensors = buckets = 0
        for bucket, last in marked_last(iter_buckets(named, config.bucket_bytes)):
            strings = payload.serialize(bucket, len(clients) * engine_tp)
            await asyncio.gather(
                *(
                    c.update_weights_from_tensor(
                        strings[i * engine_tp : (i + 1) * engine_tp],
                        weight_version=version if last else None,
                        load_format=payload.load_format,
                        flush_cache=last and flushes_after(config),
                    )
                    for i, c in enumerate(clients)
                )
            )
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            tensors += len(bucket)
            buckets += 1
    return PushStats(buckets, tensors, sent, time.perf_counter() - start)


async def push_weights_distributed(
    clients: Sequence,
    named: Iterable[NamedTensor],
    version: int,
    broadcast_bucket: Callable[[list[NamedTensor]], None],
    config: WeightSyncConfig | None = None,
    *,
    group_name: str = "weight_update_group",
    load_format: str | None = None,
    timeout_s: float | None = None,
) -> PushStats:
    """Push over an already initialised weight-update group (``init_weights_update_group``).

    For each bucket the metadata goes over HTTP while ``broadcast_bucket(bucket)`` (run in a
    daemon thread) broadcasts the tensors from the trainer rank (src 0) to the engines' ranks
    (``load_format`` says how: ``weights.group``). An engine that refuses a bucket raises here at
    once; ``serve`` then drops the group, which ends the pending broadcast with an error.
    """
    config = config or WeightSyncConfig()
    start = time.perf_counter()
    async with paused(clients, config, session=True):
        sent = tensors = buckets = 0
        for bucket, last in marked_last(iter_buckets(named, config.bucket_bytes)):
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            requests = [
                c.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    group_name=group_name,
                    weight_version=version if last else None,
                    load_format=load_format,
                    timeout_s=timeout_s,
                    flush_cache=last and flushes_after(config),
                )
                for c in clients
            ]
            results = await asyncio.gather(
                *requests, in_daemon_thread(broadcast_bucket, bucket), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:  # an engine's answer (e.g. a refusal) first: it says why a send failed
                raise errors[0]
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            tensors += len(bucket)
            buckets += 1
    return PushStats(buckets, tensors, sent, time.perf_counter() - start)


def in_daemon_thread(fn: Callable, *args) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread, as a future of the running loop. Unlike
    ``asyncio.to_thread`` a call blocked in a collective whose peer went away does not hold up
    ``asyncio.run``'s exit (the process's exit, with the error, is not delayed by it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as err:  # handed to the awaiting coroutine
            error = err
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, daemon=True, name=getattr(fn, "__name__", "worker")).start()
    return future
