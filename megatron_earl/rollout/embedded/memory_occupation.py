"""Memory release for colocated engines: SGLang's ``release_memory_occupation`` /
``resume_memory_occupation`` tags, and the weight backup the embedded engine keeps meanwhile.

    tags = parse_tags(body.get("tags"))          # None / [] -> every tag; unknown -> ValueError
    backup = WeightBackup.release(model_chunks)  # parameters emptied, values kept on the host
    backup.restore()                             # the same parameters, the same values
    await engine.release_memory_occupation(tags) # EngineMemory, mixed into EmbeddedEngine

SGLang (0.5.23, ``scheduler_components/weight_updater.py``) pauses torch_memory_saver regions per
tag: ``kv_cache`` (and flushes the prefix cache), ``weights`` and ``cuda_graph``; a resumed
``weights`` region gets its old values back only with ``--enable-weights-cpu-backup`` (otherwise
the trainer must push weights before generating, which the trainer here always does). The
embedded engine behaves as SGLang with that backup: ``WeightBackup`` moves each parameter's values
to the host (boundary "released weights", docs/devices.md) and leaves an empty tensor of the same
dtype on the device in its place, so the parameter objects -- which the batched forward holds --
stay valid; ``restore`` moves the values back. Parameters only: the forward's RoPE tables (a few
KiB) stay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_earl import runtime
from megatron_earl.config.vocab import MEMORY_TAGS, MemoryTag
from megatron_earl.rollout.embedded.step import Step
from megatron_earl.rollout.engine import RequestError

MEMORY_FIELDS = frozenset({"rid", "http_worker_ipc", "tags"})
"""Fields of SGLang's ``ReleaseMemoryOccupationReqInput`` and ``ResumeMemoryOccupationReqInput``
(the same for both)."""


def parse_tags(raw: object) -> tuple[MemoryTag, ...]:
    """SGLang's ``tags`` field: None or an empty list means every tag; otherwise a list of tag
    names (duplicates counted once, SGLang's order kept). ``ValueError`` naming the bad value and
    the valid tags."""
    if raw is None or raw == []:
        return MEMORY_TAGS
    valid = ", ".join(MEMORY_TAGS)
    if not isinstance(raw, list):
        raise ValueError(f"tags must be a list of tag names or null, got {raw!r}; valid: {valid}")
    bad = [t for t in raw if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; valid: {valid} (null or []: all)")
    return tuple(t for t in MEMORY_TAGS if t in raw)


def parameters_of(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Every distinct parameter of the chunks (a tied embedding counted once)."""
    seen: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class WeightBackup:
    """Host copies of released parameters (module docstring)."""

    params: list[nn.Parameter]
    host: list[torch.Tensor]

    @classmethod
    def release(cls, chunks: Sequence[nn.Module]) -> WeightBackup:
        """Move every parameter's values to the host and empty it on its device."""
        params = parameters_of(chunks)
        host = []
        for param in params:
            host.append(runtime.to_host(param.data))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return cls(params, host)

    @property
    def nbytes(self) -> int:
        """Bytes of the host copies."""
        return tensor_bytes(self.host)

    def restore(self) -> None:
        """Give every parameter its values back, on its device (the one it was emptied on)."""
        for param, values in zip(self.params, self.host, strict=True):
            param.data = values.to(param.device)
        self.host = []


class EngineMemory:
    """The embedded engine's colocation memory (mixed into ``EmbeddedEngine``, whose scheduler
    state and ``_run`` it uses): ``release_memory_occupation`` / ``resume_memory_occupation`` on
    the scheduler rank; each runs as one step on every rank of the TP group (``_release_local``
    / ``_resume_local``)."""

    _released: set[MemoryTag]
    _weight_backup: WeightBackup | None

    @property
    def released(self) -> tuple[MemoryTag, ...]:
        """Memory tags currently released, in SGLang's order."""
        return tuple(t for t in MemoryTag if t in self._released)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes held by the KV cache, the weights on their device and the host
        backup of released weights."""
        backup = self._weight_backup
        return {
            "kv_cache_bytes": self._forward.cache.nbytes(),
            "weight_bytes": tensor_bytes([p.data for p in parameters_of(self.model_chunks)]),
            "weight_backup_bytes": backup.nbytes if backup is not None else 0,
        }

    async def release_memory_occupation(self, tags: Sequence[MemoryTag]) -> None:
        """SGLang's ``release_memory_occupation``: free ``tags`` on every rank of the TP group.
        The engine must be idle (SGLang's rule): no request holds a KV-cache row, and requests
        wait only while generation is paused (they stay queued until every tag is resumed and
        generation continues). ``kv_cache`` also drops the parked sessions (SGLang flushes its
        cache). A tag already released, or a busy engine: ``RequestError``, nothing changes."""
        async with self._step_lock:
            again = [t for t in tags if t in self._released]
            if again:
                raise RequestError(
                    f"memory {again} is already released (released: {list(self.released)}); "
                    "resume_memory_occupation first"
                )
            await self._settle_aborts()
            waiting = 0 if self._paused else len(self._waiting)
            if self._table.items or waiting:
                raise RequestError(
                    "release_memory_occupation needs an idle engine, but "
                    f"{len(self._table.items)} requests are running and {waiting} waiting; "
                    "wait for them, or pause_generation (mode 'abort' or 'retract') first"
                )
            await self._run(Step("release", tags=tuple(tags)))
            if MemoryTag.KV_CACHE in tags:
                self._table.drop_parked()
            self._released.update(tags)

    async def resume_memory_occupation(self, tags: Sequence[MemoryTag]) -> None:
        """SGLang's ``resume_memory_occupation``: rebuild ``tags`` on every rank (the KV cache
        empty, the weights with the values they had). A tag that is not released:
        ``RequestError``, nothing changes. Generation goes on once no tag is released."""
        async with self._step_lock:
            missing = [t for t in tags if t not in self._released]
            if missing:
                raise RequestError(
                    f"memory {missing} is not released (released: {list(self.released)}); "
                    "nothing to resume"
                )
            await self._run(Step("resume", tags=tuple(tags)))
            self._released.difference_update(tags)
        self._wake.set()

    def _release_local(self, tags: Sequence[MemoryTag]) -> None:
        if MemoryTag.KV_CACHE in tags:
            self._forward.cache.release()
        if MemoryTag.WEIGHTS in tags:
            self._weight_backup = WeightBackup.release(self.model_chunks)

    def _resume_local(self, tags: Sequence[MemoryTag]) -> None:
        if MemoryTag.WEIGHTS in tags:
            self._weight_backup.restore()
            self._weight_backup = None
        if MemoryTag.KV_CACHE in tags:
            self._forward.cache.allocate()
