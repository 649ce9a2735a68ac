"""Stream a Megatron ``torch_dist`` checkpoint to and from disk one group of tensors at a time.

Writing: ``StreamingCheckpointWriter`` produces exactly what ``dist_checkpointing.save`` does
(``*.distcp`` files, the torch.distributed.checkpoint ``.metadata``, ``common.pt`` and Megatron's
``metadata.json``), but it writes one *group* (one layer) per call and keeps only the metadata:
``dist_checkpointing.save`` needs every tensor in memory at once. Each group's tensors become
chunks of the global tensors at the offsets given (a layer slice is the chunk at ``(layer, 0,
...)`` of a layer-stacked key), so Megatron loads the result in any layout and reshards on load.
It uses torch.distributed.checkpoint's own ``FileSystemWriter`` (``write_data``/``finish``) for the
file format; no process group is needed.

Reading: ``load_slices`` asks ``dist_checkpointing.load`` for one layer's slice of each stacked
tensor, described by a sharded state dict of ``ShardedTensor``s covering ``[layer:layer + 1]``;
the reader touches only the stored chunks that overlap. It needs torch.distributed initialised in a
world of its own (``runtime.initialize()`` makes a world of one); call it from one process only.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

import torch

from megatron_earl.convert.families import ConversionError

COMMON_KEY = "megatron_earl"
"""Key of this project's metadata (model config, family, ...) in ``common.pt``."""


class _Resolver:
    """The one planner method ``FileSystemWriter.write_data`` calls."""

    def __init__(self, data: dict[Any, torch.Tensor | io.BytesIO]):
        self.data = data

    def resolve_data(self, write_item):
        return self.data[write_item.index]


class StreamingCheckpointWriter:
    """Write a ``torch_dist`` checkpoint group by group (one ``__<group>_0.distcp`` file each)."""

    def __init__(self, path: str | Path):
        from torch.distributed.checkpoint import FileSystemWriter

        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._writer = FileSystemWriter(self.path, single_file_per_rank=True, thread_count=1)
        self._writer.set_up_storage_writer(True)
        self._metadata: dict[str, Any] = {}
        self._results: list[list[Any]] = []

    def write(
        self,
        tensors: list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]],
        objects: dict[str, Any] | None = None,
    ) -> None:
        """Write one group: ``(key, chunk, global offset, global shape)`` per tensor (the chunk has
        the global tensor's rank) and ``{unique key: object}`` ShardedObjects (pickled)."""
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )
        from torch.distributed.checkpoint.planner import (
            SavePlan,
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        items, data = [], {}
        for key, chunk, offset, global_shape in tensors:
            if chunk.dim() != len(global_shape) or len(offset) != len(global_shape):
                raise ValueError(
                    f"{key}: chunk {tuple(chunk.shape)} / offset {offset} / global "
                    f"shape {global_shape} differ in rank"
                )
            props = TensorProperties(dtype=chunk.dtype)
            meta = self._metadata.setdefault(
                key, TensorStorageMetadata(props, torch.Size(global_shape), [])
            )
            if meta.size != torch.Size(global_shape) or meta.properties.dtype != chunk.dtype:
                raise ValueError(f"{key}: chunks disagree on global shape or dtype")
            storage = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=chunk.shape)
            meta.chunks.append(storage)
            index = MetadataIndex(key, torch.Size(offset), len(meta.chunks) - 1)
            items.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(storage, props, torch.Size(global_shape)),
                )
            )
            data[index] = chunk.contiguous()
        for unique_key, obj in (objects or {}).items():
            self._metadata[unique_key] = BytesStorageMetadata()
            index = MetadataIndex(unique_key)
            buffer = io.BytesIO()
            torch.save([obj], buffer)  # as Megatron stores a ShardedObject: a list
            buffer.seek(0)
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            data[index] = buffer
        from torch.distributed.checkpoint.filesystem import _StoragePrefix

        plan = SavePlan(items, storage_data=_StoragePrefix(f"__{len(self._results)}_"))
        self._results.append(self._writer.write_data(plan, _Resolver(data)).wait())

    def finish(self, common: dict[str, Any]) -> None:
        """Check every tensor is fully covered, then write ``.metadata``, ``common.pt`` and
        ``metadata.json`` (last, as ``dist_checkpointing.save`` does)."""
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
        from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

        for key, meta in self._metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                covered = sum(math.prod(c.sizes) for c in meta.chunks)
                if covered != math.prod(meta.size):
                    raise ValueError(f"{key}: chunks cover {covered} of {math.prod(meta.size)}")
        self._writer.finish(Metadata(state_dict_metadata=self._metadata), self._results)
        torch.save(common, self.path / "common.pt")
        save_config(CheckpointingConfig("torch_dist", 1), str(self.path))


def check_checkpoint(ckpt_dir: str | Path) -> dict[str, Any]:
    """Validate a ``torch_dist`` checkpoint directory; return its tensors' metadata
    (key -> ``TensorStorageMetadata``). Raises ``ConversionError`` naming a missing file."""
    ckpt = Path(ckpt_dir)
    for name in ("metadata.json", ".metadata", "common.pt"):
        if not (ckpt / name).is_file():
            raise ConversionError(
                f"{ckpt / name} not found: {ckpt} is not a complete Megatron torch_dist checkpoint"
            )
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    by_file: dict[str, list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        by_file.setdefault(info.relative_path, []).append(index.fqn)
    for name, keys in sorted(by_file.items()):
        if not (ckpt / name).is_file():
            raise ConversionError(
                f"checkpoint shard {ckpt / name} is missing (it holds {sorted(set(keys))[:4]})"
            )
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k: v
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def load_common(ckpt_dir: str | Path) -> dict[str, Any]:
    """``common.pt`` of a checkpoint (this project's metadata lives under ``COMMON_KEY``)."""
    return torch.load(Path(ckpt_dir) / "common.pt", map_location="cpu", weights_only=False)


def load_slices(
    ckpt_dir: str | Path, requests: dict[str, tuple[torch.Size, torch.dtype, int | None]]
) -> dict[str, torch.Tensor]:
    """Load ``{key: (global shape, dtype, layer)}``: the whole tensor when ``layer`` is None, else
    the slice ``[layer]`` of the layer-stacked tensor (without the layer axis).

    Which ranks call: one process in a world of its own (``dist_checkpointing.load`` runs DCP's
    plan exchange over the default group).
    """
    from megatron.core.dist_checkpointing import ShardedTensor, serialization

    sharded = {}
    for key, (shape, dtype, layer) in requests.items():
        if layer is None:
            sharded[key] = ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype))
        else:
            # The layer axis as a real axis of size 1, not a prepended one: megatron-core turns
            # a prepended-axis subset of a regular grid into a torch ShardedTensor whose other
            # shards it places on "rank + 1 mod world" -- this rank, in a world of one.
            local = torch.empty((1, *shape[1:]), dtype=dtype)
            sharded[key] = ShardedTensor.from_rank_offsets(key, local, (0, layer, shape[0]))
    loaded = serialization.load(sharded, str(ckpt_dir), validate_access_integrity=False)
    return {
        key: loaded[key] if layer is None else loaded[key][0]
        for key, (_, _, layer) in requests.items()
    }
