"""The payloads of ``update_weights_from_tensor`` (``serialized_named_tensors``), on both sides.

    payload = TensorPayloadFormat(TensorPayload.SGLANG, FLATTENED)   # rollout.sglang settings
    strings = payload.serialize(bucket)     # trainer: one string per engine TP rank, each once
    named = decode_payload(strings[0], load_format)   # megatron-earl serve: either format

Two formats (``rollout.sglang.tensor_payload``):

* ``portable``: base64 of ``torch.save([(name, tensor), ...])``, loaded with
  ``torch.load(weights_only=True)``. The bytes travel, so any host works; only
  ``megatron-earl serve`` reads it.
* ``sglang``: SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` format,
  written here (SGLang is not imported): base64 of a ``multiprocessing.reduction.ForkingPickler``
  dump with torch's multiprocessing reductions. Only handles travel, never the bytes, so the
  receiver must be on the sender's node: a CUDA tensor is a CUDA IPC handle (same node, GPUs
  visible to both; the device is named by its UUID, as SGLang's own sender does), a CPU tensor a
  named shared-memory segment (torch's "file_system" strategy, whatever the process's sharing
  strategy is). Measured on CPU: torch's default "file_descriptor" strategy does not work
  between independent processes (the fd is handed over by the sender's
  ``multiprocessing.resource_sharer``, which authenticates with the sender's multiprocessing
  authkey: a server not started by the trainer gets ``AuthenticationError``); named segments
  do, and survive the sender's copy (the sender holds one reference for the receiver, which the
  receiver drops). A payload is opened once: serialize one per receiver (engine TP rank), like
  SGLang's ``Engine`` -- a payload nobody opens leaves its segment in ``/dev/shm``.

  ``load_format`` (SGLang's names): None -> ``obj`` is a list of (name, tensor) pairs (SGLang
  loads them with the model's ``load_weights``); ``"flattened_bucket"`` -> ``obj`` is
  ``{"flattened_tensor": uint8 tensor, "metadata": [m, ...]}`` with ``m.name, m.shape, m.dtype,
  m.start_idx, m.end_idx, m.numel`` (byte offsets; SGLang's ``FlattenedTensorMetadata`` fields,
  the layout of ``weights.group.flatten_bucket``). The metadata travel as
  ``types.SimpleNamespace`` (SGLang's unpickler allows it and its loader reads the fields by
  attribute); a payload made by SGLang's own ``FlattenedTensorBucket`` is read too.

Reading an ``sglang`` payload never runs a plain ``pickle.loads``: ``RestrictedUnpickler``
resolves only the globals the format needs (torch's CPU tensor/storage rebuild functions,
``torch.Size``, dtypes, ``SimpleNamespace``); any other global is refused with
``RefusedGlobal`` naming it, before it is called. A shared-memory segment is opened only if it
looks like torch's (``/torch_<pid>_<n>_<n>`` under torch's manager socket) and holds the bytes the
payload claims (a shorter one would crash the reader on access).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import re
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from megatron_earl.config.vocab import TensorPayload
from megatron_earl.rollout.weights.group import (
    FLATTENED,
    NamedTensor,
    flatten_bucket,
    unflatten_bucket,
)

LOAD_FORMATS = (None, "direct", FLATTENED)
"""``load_format`` values serve reads; "direct" is read like None (serve's names are HF names;
SGLang's "direct" copies into its own, fused, parameter names, which the trainer does not
send)."""


@dataclass(frozen=True)
class TensorPayloadFormat:
    """How the trainer serializes one bucket (``rollout.sglang.tensor_payload`` and
    ``tensor_load_format``)."""

    kind: TensorPayload = TensorPayload.PORTABLE
    load_format: str | None = None
    """The request's ``load_format``: None or ``"flattened_bucket"`` (``sglang`` only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TensorPayload(self.kind))
        if self.load_format not in (None, FLATTENED):
            raise ValueError(f"load_format {self.load_format!r} is not one of None, {FLATTENED!r}")
        if self.load_format == FLATTENED and self.kind != TensorPayload.SGLANG:
            raise ValueError(f"load_format {FLATTENED!r} needs the sglang payload, not portable")

    def serialize(self, bucket: Sequence[NamedTensor], num_receivers: int = 1) -> list[str]:
        """``num_receivers`` payloads of ``bucket``: a portable one repeated, or one sglang
        payload each (each receiver opens its own handles once)."""
        if self.kind == TensorPayload.PORTABLE:
            return [serialize_portable(bucket)] * num_receivers
        return [serialize_sglang(bucket, self.load_format) for _ in range(num_receivers)]


# ---------------------------------------------------------------------------------- portable


def serialize_portable(named: Sequence[NamedTensor]) -> str:
    """Portable payload: base64 of ``torch.save([(name, tensor), ...])`` (contiguous CPU copies)."""
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu().contiguous()) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _load_portable(raw: bytes) -> list[NamedTensor]:
    try:
        items = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as err:
        raise ValueError(
            "payload is not a torch.save'd list of (name, tensor) pairs (the portable format of "
            f"megatron_earl.rollout.weights.tensor_payload.serialize_portable): {err}"
        ) from None
    return _named_pairs(items)


def _named_pairs(items: Any) -> list[NamedTensor]:
    if not isinstance(items, list) or not all(
        isinstance(i, (list, tuple))
        and len(i) == 2
        and isinstance(i[0], str)
        and isinstance(i[1], torch.Tensor)
        for i in items
    ):
        raise ValueError("payload must decode to a list of (name, tensor) pairs")
    return [(n, t) for n, t in items]


# ---------------------------------------------------------------------------------- sglang


def serialize_sglang(named: Sequence[NamedTensor], load_format: str | None = None) -> str:
    """SGLang's ``MultiprocessingSerializer`` payload of ``named`` (module docstring). CPU
    tensors are copied into new shared-memory segments (the trainer's own tensors stay where
    they are); CUDA tensors are shared as they are and must not change until the engines
    loaded them."""
    if load_format == FLATTENED:
        flat = flatten_bucket(named)
        metadata, offset = [], 0
        for name, tensor in named:
            size = tensor.numel() * tensor.element_size()
            metadata.append(
                SimpleNamespace(name=name, shape=torch.Size(tensor.shape), dtype=tensor.dtype,
                                start_idx=offset, end_idx=offset + size, numel=size)
            )  # fmt: skip
            offset += size
        obj: Any = {"flattened_tensor": flat, "metadata": metadata}
    elif load_format is None:
        obj = [(n, t.detach() if t.is_cuda else t.detach().clone()) for n, t in named]
    else:
        raise ValueError(f"load_format {load_format!r} is not one of None, {FLATTENED!r}")
    return dump_sglang(obj)


def dump_sglang(obj: Any) -> str:
    """base64 ``ForkingPickler`` dump of ``obj`` with torch's reductions, CPU storages as named
    shared memory and CUDA devices by UUID."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _reduce_tensor(tensor: torch.Tensor):
    """torch's reduction; a CUDA device travels as its UUID (SGLang's patched reduction: the
    engine's device index of the same GPU may differ)."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
        args = (*args[:6], uuid, *args[7:])
    return rebuild, args


def _reduce_storage(storage: torch.UntypedStorage):
    """A CPU storage as a named shared-memory segment (torch's "file_system" reduction)."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)  # raises, naming the device
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    _start_shm_manager_quietly()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's reference, dropped by rebuild_storage_filename
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


_shm_manager_started = False


def _start_shm_manager_quietly() -> None:
    """torch starts its shared-memory manager (``torch_shm_manager``) at a process's first named
    segment, as a daemon that inherits the process's stdout/stderr and lives on while engines
    hold segments of it: a launcher reading this process's output would wait for it after this
    process ended (measured: ``subprocess.run(capture_output=True)`` of the trainer hangs).
    Start it once with /dev/null as its stdout and stderr."""
    global _shm_manager_started
    if _shm_manager_started:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        torch.UntypedStorage(1)._share_filename_cpu_()  # starts the manager; freed at once
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
    _shm_manager_started = True


class RefusedGlobal(ValueError):
    """An ``sglang`` payload names a global the format does not need."""


@dataclass
class FlattenedTensorMetadata:
    """Stands in for SGLang's class of that name when a payload made by SGLang's
    ``FlattenedTensorBucket`` is read (same fields; SGLang is not imported)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_SHM_HANDLE = re.compile(rb"/torch_\d+_\d+_\d+")
_SHM_MANAGER = re.compile(rb"/[^\0]*/torch-shm-dir-[^/\0]+/manager\.sock")


def _rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    """torch's ``rebuild_storage_filename`` for torch's segments that hold ``size`` bytes."""
    if cls is not torch.UntypedStorage or dtype is not None:
        raise ValueError(f"shared storage of type {cls!r} (dtype {dtype!r}) is not expected")
    if not (isinstance(handle, bytes) and _SHM_HANDLE.fullmatch(handle)):
        raise ValueError(f"shared-memory name {handle!r} is not one of torch's (/torch_<pid>_..)")
    if not (isinstance(manager, bytes) and _SHM_MANAGER.fullmatch(manager)):
        raise ValueError(f"{manager!r} is not torch's shared-memory manager socket")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"shared storage size {size!r} is not a non-negative integer")
    try:
        have = os.stat(b"/dev/shm" + handle).st_size
        is_socket = stat.S_ISSOCK(os.stat(manager).st_mode)
    except OSError as err:
        raise ValueError(
            f"shared-memory segment {handle.decode()} cannot be opened ({err.strerror}): the "
            "sglang payload works only on the sender's host, while the sender is alive, once"
        ) from None
    if have < size or not is_socket:
        raise ValueError(
            f"shared-memory segment {handle.decode()} holds {have} bytes, the payload claims {size}"
        )
    return reductions.rebuild_storage_filename(cls, manager, handle, size)


_R = "torch.multiprocessing.reductions"
_ALLOWED: dict[tuple[str, str], Any] = {
    (_R, "rebuild_tensor"): reductions.rebuild_tensor,
    (_R, "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    (_R, "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    (_R, "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "Size"): torch.Size,
    ("types", "SimpleNamespace"): SimpleNamespace,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
}
_CUDA = (
    "a CUDA IPC handle (a CUDA tensor of the trainer): megatron-earl serve runs on CPU; send "
    "CPU tensors or the portable payload"
)
_EXPLAINED = {
    (_R, "rebuild_cuda_tensor"): _CUDA,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _CUDA,
    (_R, "rebuild_storage_fd"): (
        "a file descriptor of torch's 'file_descriptor' sharing strategy, which only the "
        "sender's multiprocessing children can receive; megatron_earl's serializer sends CPU "
        "tensors as named shared memory"
    ),
}
_EXPLAINED[("multiprocessing.resource_sharer", "DupFd")] = _EXPLAINED[(_R, "rebuild_storage_fd")]


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals of an ``sglang`` payload (``_ALLOWED``); ``RefusedGlobal``
    names any other (nothing it names is imported or called)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        why = _EXPLAINED.get((module, name), "the sglang payload format does not use it")
        raise RefusedGlobal(f"payload refers to {module}.{name}, refused: {why}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of the sglang payload format")


def _load_sglang(raw: bytes, load_format: str | None) -> list[NamedTensor]:
    try:
        obj = RestrictedUnpickler(io.BytesIO(raw)).load()
    except RefusedGlobal:
        raise
    except Exception as err:
        raise ValueError(f"payload is not a valid sglang (ForkingPickler) payload: {err}") from None
    if load_format != FLATTENED:
        if isinstance(obj, dict):
            raise ValueError(f"payload holds a flattened bucket; send load_format {FLATTENED!r}")
        return _named_pairs(obj)
    if not (isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}):
        raise ValueError(
            f"a {FLATTENED!r} payload is a dict of 'flattened_tensor' and 'metadata', got "
            f"{type(obj).__name__}"
            + (f" with keys {sorted(map(str, obj))}" if isinstance(obj, dict) else "")
        )
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or not isinstance(metadata, list) or not metadata:
        raise ValueError("flattened_tensor must be a tensor and metadata a non-empty list")
    names, dtypes, shapes, offset = [], [], [], 0
    for m in metadata:
        fields = [getattr(m, f, None) for f in ("name", "shape", "dtype", "start_idx", "end_idx")]
        name, shape, dtype, start, end = fields
        if not (
            isinstance(name, str)
            and isinstance(shape, (torch.Size, tuple, list))
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(dtype, torch.dtype)
        ):
            raise ValueError(f"flattened bucket metadata {m!r:.200} lacks name, shape or dtype")
        size = torch.Size(shape).numel() * dtype.itemsize
        if (start, end, getattr(m, "numel", None)) != (offset, offset + size, size):
            raise ValueError(
                f"flattened bucket: {name} spans bytes [{start}, {end}) (numel "
                f"{getattr(m, 'numel', None)}); its place is [{offset}, {offset + size})"
            )
        names.append(name)
        dtypes.append(dtype)
        shapes.append(tuple(shape))
        offset += size
    return unflatten_bucket(flat, names, dtypes, shapes)


def is_portable(payload: Any) -> bool:
    """Whether a payload is the portable format (its bytes start a zip archive)."""
    if not isinstance(payload, str):
        return False
    try:
        return base64.b64decode(payload[:8], validate=True)[:4] == b"PK\x03\x04"
    except (ValueError, TypeError):
        return False


def decode_payload(payload: Any, load_format: str | None = None) -> list[NamedTensor]:
    """(name, tensor) pairs of one ``serialized_named_tensors`` entry, in either format
    (told apart by their bytes: a zip archive is portable, a pickle is sglang). ``ValueError``
    (``RefusedGlobal`` for a refused global) says what is wrong; nothing is applied here."""
    return load_payload(payload_bytes(payload), load_format)


def take_payload(payloads: list[Any], index: int, load_format: str | None) -> list[NamedTensor]:
    """``decode_payload(payloads[index])``, dropping the entry from ``payloads`` once its bytes
    are decoded: a payload of B bytes then peaks at 1.75B (the string, its bytes), then 1.5B
    (the bytes, the tensors), not 2.5B. The list is the only holder to drop (a caller in another
    thread passes the list, not the string, which the executor's work item would keep alive)."""
    raw = payload_bytes(payloads[index])
    payloads[index] = None
    return load_payload(raw, load_format)


def payload_bytes(payload: Any) -> bytes:
    """The bytes a ``serialized_named_tensors`` entry (a base64 string) carries (``ValueError``
    when it is not base64)."""
    if not isinstance(payload, str):
        raise ValueError(f"a payload is a base64 string, got {type(payload).__name__}")
    try:  # binascii reads the string in place (b64decode would first copy it into bytes)
        return binascii.a2b_base64(payload, strict_mode=True)
    except (ValueError, TypeError) as err:
        raise ValueError(f"payload is not valid base64: {err}") from None


def load_payload(raw: bytes, load_format: str | None = None) -> list[NamedTensor]:
    """(name, tensor) pairs of a payload's bytes (``payload_bytes``), in either format."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
    if raw[:4] == b"PK\x03\x04":
        if load_format == FLATTENED:
            raise ValueError(f"load_format {FLATTENED!r} needs the sglang payload, not portable")
        return _load_portable(raw)
    if raw[:1] == b"\x80":
        return _load_sglang(raw, load_format)
    raise ValueError(
        "payload is neither portable (a torch.save zip archive) nor sglang (a pickle); "
        f"it starts with {raw[:8]!r}"
    )
