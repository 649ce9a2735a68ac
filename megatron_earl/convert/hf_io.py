"""Read and write Hugging Face safetensors checkpoints tensor by tensor.

``HFReader`` reads ``model.safetensors`` or a sharded ``model.safetensors.index.json`` directory;
every shard the index names must exist (else ``ConversionError`` naming the file and tensors it
holds). ``read`` opens each shard only for the tensors asked for and closes it again, so the
process never keeps a whole shard mapped. ``confined=True`` (a directory named by an untrusted
client, e.g. ``serve``'s disk update): the index, the single file and every shard the index names
must resolve (symlinks followed) to a regular file inside the directory, else ``PermissionError``
before anything is read or any other file is looked at.

``ShardedSafetensorsWriter`` buffers tensors up to ``max_shard_bytes`` and then writes a shard, so
at most one shard's worth of output is held; ``finish`` names the shards
``model-0000i-of-0000N.safetensors`` and writes the index (``metadata.total_size`` +
``weight_map``) that ``transformers`` loads.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from megatron_earl.convert.families import ConversionError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFReader:
    """Tensor names and lazy reads of an HF model directory."""

    def __init__(self, hf_dir: str | Path, *, confined: bool = False):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX
        if confined:
            _check_inside(self.dir, [INDEX, SINGLE])
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE).is_file():
            weight_map = {name: SINGLE for name in _names_in(self.dir / SINGLE)}
        else:
            raise ConversionError(f"{self.dir} has neither {INDEX} nor {SINGLE}")
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, file in weight_map.items():
            by_file[file].append(name)
        if confined:
            _check_inside(self.dir, list(by_file))
        for file, names in sorted(by_file.items()):
            if not (self.dir / file).is_file():
                raise ConversionError(
                    f"safetensors shard {self.dir / file} is missing (it holds {sorted(names)[:4]}"
                    f"{' ...' if len(names) > 4 else ''})"
                )
        self.weight_map: dict[str, str] = dict(weight_map)

    def names(self) -> set[str]:
        return set(self.weight_map)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors (each shard opened once, closed after)."""
        from safetensors import safe_open

        missing = [n for n in names if n not in self.weight_map]
        if missing:
            raise ConversionError(f"tensor(s) {missing} missing from the HF checkpoint {self.dir}")
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.weight_map[name]].append(name)
        out = {}
        for file, file_names in by_file.items():
            with safe_open(self.dir / file, framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name).clone()
        return out


def _check_inside(directory: Path, files: list[str]) -> None:
    """``PermissionError`` unless each of ``files`` (names relative to ``directory``; absent
    ones pass) resolves inside the resolved ``directory`` to a regular file."""
    root = directory.resolve()
    for file in files:
        if not isinstance(file, str) or not file:
            raise PermissionError(f"file name {file!r} in {directory} is not a relative path")
        resolved = (root / file).resolve()
        if not resolved.is_relative_to(root):
            raise PermissionError(
                f"file {file!r} of {directory} resolves outside the directory; only files "
                "inside it are read"
            )
        if resolved.exists() and not resolved.is_file():
            raise PermissionError(f"file {file!r} of {directory} is not a regular file")


def _names_in(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())


class ShardedSafetensorsWriter:
    """Write tensors into size-bounded safetensors shards plus the index."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Queue tensors; a shard is written once the queue reaches ``max_shard_bytes``."""
        for name, tensor in tensors.items():
            if name in self._buffer or any(name in s for s in self._shards):
                raise ValueError(f"tensor {name} written twice")
            self._buffer[name] = tensor.contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            self._buffer_bytes += nbytes
            self._total += nbytes
        if self._buffer_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buffer:
            return
        save_file(
            self._buffer, self.dir / f"shard-{len(self._shards)}.tmp", metadata={"format": "pt"}
        )
        self._shards.append(sorted(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    @property
    def total_bytes(self) -> int:
        """Tensor bytes added so far."""
        return self._total

    def finish(self) -> None:
        """Write the last shard, give the shards their final names, write the index."""
        self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.dir / f"shard-{i}.tmp").rename(self.dir / final)
            weight_map.update((n, final) for n in names)
        index = {
            "metadata": {"total_size": self._total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
