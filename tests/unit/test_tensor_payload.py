"""The ``update_weights_from_tensor`` payload formats (``rollout.weights.tensor_payload``): SGLang's
``MultiprocessingSerializer`` format written here (CPU tensors as named shared memory) is read
back by another process of this host, in both ``load_format``s; its restricted reader refuses
every global the format does not need before anything runs (``os.system``, torch's
file-descriptor handles, CUDA IPC handles), and bad layouts and shared-memory claims; the
globals the payloads name are all in the pinned SGLang's own unpickler allow-list (read from
the cached wheel with ``ast``, never imported)."""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import os
import pickle
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from megatron_earl.config.sglang import SGLangConfig, SGLangConfigError
from megatron_earl.rollout.sglang.client import SGLANG_PINNED
from megatron_earl.rollout.weights.group import FLATTENED
from megatron_earl.rollout.weights.tensor_payload import (
    RefusedGlobal,
    RestrictedUnpickler,
    TensorPayloadFormat,
    decode_payload,
    dump_sglang,
    serialize_portable,
    serialize_sglang,
)

REPO = Path(__file__).resolve().parents[2]
NAMED = [
    ("model.embed_tokens.weight", torch.randn(6, 4)),
    ("model.norm.weight", torch.arange(3, dtype=torch.int64)),
    ("lm_head.weight", torch.randn(2, 5, dtype=torch.bfloat16)),
    ("odd", torch.randn(4, 6)[:, ::2]),  # a non-contiguous view
]
FORMATS = [None, FLATTENED]


def _same(named, back) -> None:
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _globals(payload: str) -> set[tuple[str, str]]:
    """The globals a payload names (read as serve reads it, recording each lookup)."""
    found = set()

    class Recorder(RestrictedUnpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(base64.b64decode(payload))).load()
    return found


@pytest.mark.parametrize("load_format", FORMATS, ids=["tensors", "flattened"])
def test_sglang_payload_is_read_by_another_process(load_format):
    payload = serialize_sglang(NAMED, load_format)
    code = (
        "import sys, torch\n"
        "from megatron_earl.rollout.weights.tensor_payload import decode_payload\n"
        f"named = decode_payload(sys.stdin.read(), {load_format!r})\n"
        "torch.save([(n, t.clone()) for n, t in named], sys.stdout.buffer)\n"
        "del named  # closes the segments (the last reader's close removes them)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=payload.encode(), capture_output=True, timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()
    _same(NAMED, torch.load(io.BytesIO(out.stdout), weights_only=True))
    # the bytes stay here: a payload of a 256 KiB tensor is a few hundred bytes of handles
    big = [("w", torch.zeros(256, 256))]
    small = serialize_sglang(big, load_format)
    assert len(small) < 2000 < 256 << 10 < len(serialize_portable(big))
    _same(big, decode_payload(small, load_format))  # opened once: its segment goes away


@pytest.mark.parametrize("load_format", FORMATS, ids=["tensors", "flattened"])
def test_sglang_payload_round_trip_and_format_detection(load_format):
    _same(NAMED, decode_payload(serialize_sglang(NAMED, load_format), load_format))
    _same(NAMED, decode_payload(serialize_portable(NAMED)))
    with pytest.raises(ValueError, match="needs the sglang payload"):
        decode_payload(serialize_portable(NAMED), FLATTENED)
    other = None if load_format == FLATTENED else FLATTENED
    with pytest.raises(ValueError, match="flattened"):
        decode_payload(serialize_sglang(NAMED, load_format), other)
    with pytest.raises(ValueError, match="neither portable"):
        decode_payload(base64.b64encode(b"hello").decode())
    with pytest.raises(ValueError, match="base64"):
        decode_payload("@@@")


def test_one_payload_per_receiver():
    fmt = TensorPayloadFormat("sglang", FLATTENED)
    strings = fmt.serialize(NAMED, 3)
    assert len(set(strings)) == 3  # each receiver opens its own segment once
    for s in strings:
        _same(NAMED, decode_payload(s, FLATTENED))
    assert len(set(TensorPayloadFormat().serialize(NAMED, 2))) == 1
    with pytest.raises(ValueError, match="needs the sglang payload"):
        TensorPayloadFormat("portable", FLATTENED)


class _System:
    def __reduce__(self):
        import os

        return os.system, ("touch " + str(self.marker),)


def test_a_foreign_global_is_refused_and_nothing_runs(tmp_path):
    evil = _System()
    evil.marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps([("lm_head.weight", evil)])).decode()
    with pytest.raises(RefusedGlobal, match=r"refers to posix\.system|refers to os\.system"):
        decode_payload(payload)
    assert not evil.marker.exists()
    for module, name in [
        ("builtins", "eval"),
        ("torch", "load"),
        ("torch._utils", "_rebuild_tensor"),
    ]:
        raw = b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8c"
        raw += bytes([len(name)]) + name.encode() + b"\x93."
        with pytest.raises(RefusedGlobal, match=rf"refers to {module}\.{name}, refused"):
            decode_payload(base64.b64encode(raw).decode())


def test_file_descriptor_handles_are_refused_with_the_reason():
    """torch's default CPU reduction passes an fd through the sender's resource sharer, which
    only its own multiprocessing children can reach: refused, saying so."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("x", torch.ones(3))])  # process-wide strategy: file_descriptor
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    with pytest.raises(RefusedGlobal, match=r"rebuild_storage_fd.*multiprocessing children"):
        decode_payload(base64.b64encode(buf.getvalue()).decode())


def _dump_with_storage(reduce_storage) -> str:
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.UntypedStorage] = reduce_storage
    pickler.dump([("x", torch.ones(4).clone())])
    return base64.b64encode(buf.getvalue()).decode()


def test_shared_memory_claims_are_checked_before_mapping():
    segments = []

    def claims_more(storage):
        manager, handle, size = storage._share_filename_cpu_()
        storage._shared_incref()
        segments.append(b"/dev/shm" + handle)  # refused, so never opened: removed below
        return reductions.rebuild_storage_filename, (type(storage), manager, handle, size * 1000)

    def foreign_name(storage):
        manager, _, size = storage._share_filename_cpu_()
        return reductions.rebuild_storage_filename, (type(storage), manager, b"/etc", size)

    with pytest.raises(ValueError, match=r"holds \d+ bytes, the payload claims 16000"):
        decode_payload(_dump_with_storage(claims_more))
    for path in segments:
        os.unlink(path)
    with pytest.raises(ValueError, match="is not one of torch's"):
        decode_payload(_dump_with_storage(foreign_name))


def test_flattened_layouts_are_checked():
    flat = torch.zeros(16, dtype=torch.uint8)
    meta = [types.SimpleNamespace(name="a", shape=torch.Size([2]), dtype=torch.float32,
                                  start_idx=0, end_idx=8, numel=8),
            types.SimpleNamespace(name="b", shape=torch.Size([2]), dtype=torch.float32,
                                  start_idx=4, end_idx=12, numel=8)]  # fmt: skip
    payload = dump_sglang({"flattened_tensor": flat, "metadata": meta})
    with pytest.raises(ValueError, match=r"b spans bytes \[4, 12\).*its place is \[8, 16\)"):
        decode_payload(payload, FLATTENED)


def test_sglangs_own_flattened_metadata_class_is_read(monkeypatch):
    """A payload made by SGLang's ``FlattenedTensorBucket`` names SGLang's metadata class; a
    stand-in module (this test only) lets it be written without SGLang."""

    @dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    path = "sglang.srt.weight_sync.tensor_bucket"
    FlattenedTensorMetadata.__module__ = path
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    for part in ("sglang", "sglang.srt", "sglang.srt.weight_sync", path):
        monkeypatch.setitem(sys.modules, part, types.ModuleType(part))
    sys.modules[path].FlattenedTensorMetadata = FlattenedTensorMetadata
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in NAMED])
    meta, offset = [], 0
    for name, t in NAMED:
        size = t.numel() * t.element_size()
        meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + size, size))
        offset += size
    first, second = (dump_sglang({"flattened_tensor": flat, "metadata": meta}) for _ in "12")
    monkeypatch.undo()  # the reader does not need the stand-in
    assert (path, "FlattenedTensorMetadata") in _globals(first)  # (opens first's segment)
    _same(NAMED, decode_payload(second, FLATTENED))


def _sglang_wheel_sources(*paths: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("s", REPO / "scripts/sglang_schema.py")
    schema = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(schema)
    wheel = schema.find_wheel(SGLANG_PINNED, download=True)
    if wheel is None:
        pytest.skip(f"sglang=={SGLANG_PINNED} cannot be downloaded (no network?)")
    with zipfile.ZipFile(wheel) as zf:
        return [zf.read(p).decode() for p in paths]


def test_payload_globals_are_in_sglangs_allow_list_and_fields_are_its_own():
    common, updater = _sglang_wheel_sources(
        "sglang/srt/utils/common.py",
        "sglang/srt/model_executor/model_runner_components/weight_updater.py",
    )
    allowed = None
    for node in ast.walk(ast.parse(common)):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for item in node.body:
                if isinstance(item, ast.Assign) and item.targets[0].id == "ALLOWED_GLOBALS":
                    allowed = ast.literal_eval(item.value)
    assert allowed, "SafeUnpickler.ALLOWED_GLOBALS not found in the wheel"
    for load_format in FORMATS:
        used = _globals(serialize_sglang(NAMED, load_format))
        assert used and used <= allowed, sorted(used - allowed)
    # SGLang's flattened-bucket loader reads these fields of each metadata entry
    tree = ast.parse(updater)
    fn = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "_update_weights_from_flattened_bucket"
    )
    read = {
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "meta"
    }
    keys = {
        n.slice.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
    }
    assert read == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
    assert keys == {"flattened_tensor", "metadata"}


def test_config_tensor_payload_settings():
    assert SGLangConfig(tensor_payload="sglang", tensor_load_format=FLATTENED).tensor_payload == (
        "sglang"
    )
    with pytest.raises(SGLangConfigError, match="needs tensor_payload 'sglang'"):
        SGLangConfig(tensor_load_format=FLATTENED)
    with pytest.raises(SGLangConfigError, match="tensor_payload: unknown TensorPayload 'pickle'"):
        SGLangConfig(tensor_payload="pickle")
    with pytest.raises(SGLangConfigError, match="tensor_load_format 'direct' is not one of"):
        SGLangConfig(tensor_load_format="direct")
