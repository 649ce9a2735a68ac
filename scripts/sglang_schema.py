"""Parse the request schema of the pinned SGLang wheel (``ast``, never imported) into the JSON
fixture the contract tests read, so they run without the wheel (CI, no network).

    python scripts/sglang_schema.py            # writes tests/fixtures/sglang_schema_<version>.json
    python scripts/sglang_schema.py --check    # exit 1 when the fixture differs from a fresh parse

The wheel (``sglang==SGLANG_PINNED``, ``megatron_earl.rollout.sglang.client``) is taken from the
cache directory ``$MEGATRON_EARL_CACHE/sglang-<version>`` (default ``~/.cache/megatron_earl``),
downloaded there with ``pip download --no-deps`` when missing (``--no-download`` to forbid).

What is recorded, per class: each field, whether it has a default, and the default's value when
it is a literal (``field(default=...)`` unwrapped; ``null`` with the source text otherwise).
Classes: the request dataclasses of ``sglang/srt/managers/io_struct.py`` the client and ``serve``
use, ``SamplingParams`` of ``sglang/srt/sampling/sampling_params.py`` (fields inherited from
classes of the same file included), and the HTTP JSON contract of ``/generate``
(``sglang/api/v1/api_types.py``: ``GenerateRequest``, ``SamplingParams``), which SGLang checks
every ``/generate`` body against before the dataclass parse. For the info endpoints: the
response types of ``api_types.py`` (``GetModelInfoResponse``, ``GetServerInfoResponse``,
``ModelCard``), the OpenAI ``ModelCard`` / ``ModelList`` of ``entrypoints/openai/protocol.py``
(``/v1/models``) and the keys ``http_server.py``'s ``model_info`` answers (``responses``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_earl.rollout.sglang.client import SGLANG_PINNED  # noqa: E402

SOURCES = {
    "io_struct": "sglang/srt/managers/io_struct.py",
    "sampling": "sglang/srt/sampling/sampling_params.py",
    "api": "sglang/api/v1/api_types.py",
    "openai": "sglang/srt/entrypoints/openai/protocol.py",
    "http_server": "sglang/srt/entrypoints/http_server.py",
}
CLASSES = {
    "io_struct": (
        "GenerateReqInput",
        "AbortReq",
        "PauseGenerationReqInput",
        "ContinueGenerationReqInput",
        "FlushCacheReqInput",
        "UpdateWeightsFromTensorReqInput",
        "UpdateWeightFromDiskReqInput",
        "InitWeightsUpdateGroupReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "DestroyWeightsUpdateGroupReqInput",
        "BeginWeightUpdateReqInput",
        "EndWeightUpdateReqInput",
        "ReleaseMemoryOccupationReqInput",
        "ResumeMemoryOccupationReqInput",
        "GetWeightsByNameReqInput",
    ),
    "sampling": ("SamplingParams",),
    "api": (
        "GenerateRequest",
        "SamplingParams",
        "GetModelInfoResponse",
        "GetServerInfoResponse",
        "ModelCard",
    ),
    "openai": ("ModelCard", "ModelList"),
}
"""Classes recorded, by source; the fixture names them ``<source>.<class>``."""
RESPONSES = {"http_server": ("model_info",)}
"""Handlers whose answer is a dict literal assigned to ``result``; the fixture records its keys
under ``responses`` as ``<source>.<handler>``."""


def fixture_path(version: str = SGLANG_PINNED) -> Path:
    return REPO / "tests" / "fixtures" / f"sglang_schema_{version}.json"


def cache_dir(version: str = SGLANG_PINNED) -> Path:
    root = os.environ.get("MEGATRON_EARL_CACHE") or Path.home() / ".cache" / "megatron_earl"
    return Path(root) / f"sglang-{version}"


def find_wheel(version: str = SGLANG_PINNED, download: bool = True) -> Path | None:
    """The cached wheel of ``sglang==version``; downloaded when missing and ``download``.
    None when it cannot be had (the caller says why it matters)."""
    cache = cache_dir(version)
    wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not wheels and download:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        cmd += ["-d", str(cache), f"sglang=={version}"]
        try:
            subprocess.run(cmd, check=True, timeout=300, capture_output=True)
        except (subprocess.SubprocessError, OSError):
            return None
        wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    return wheels[0] if wheels else None


def read_sources(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        return {key: zf.read(path).decode() for key, path in SOURCES.items()}


def _default(node: ast.expr | None) -> dict[str, Any]:
    """``{"has_default", "default"[, "default_source"]}`` of an annotated assignment's value."""
    if node is None:
        return {"has_default": False}
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field":
        kw = {k.arg: k.value for k in node.keywords}
        if "default" in kw:
            node = kw["default"]
        elif "default_factory" in kw:
            factory = ast.unparse(kw["default_factory"])
            return {"has_default": True, "default": {"list": [], "dict": {}}.get(factory)}
        else:
            return {"has_default": False}
    try:
        return {"has_default": True, "default": ast.literal_eval(node)}
    except ValueError:
        return {"has_default": True, "default": None, "default_source": ast.unparse(node)}


def class_fields(source: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``{class: {field: default info}}`` of every class in ``source``, fields inherited from
    classes of the same file first (dataclass / msgspec order)."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, dict[str, dict[str, Any]]] = {}

    def fields(name: str) -> dict[str, dict[str, Any]]:
        if name not in out:
            result: dict[str, dict[str, Any]] = {}
            for base in classes[name].bases:
                if isinstance(base, ast.Name) and base.id in classes:
                    result.update(fields(base.id))
            for stmt in classes[name].body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if "ClassVar" not in ast.unparse(stmt.annotation):
                        result[stmt.target.id] = _default(stmt.value)
            out[name] = result
        return out[name]

    for name in classes:
        fields(name)
    return out


def response_keys(source: str, handler: str) -> list[str]:
    """Keys of the dict literal a handler function of ``source`` assigns to ``result``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == handler:
            for stmt in ast.walk(node):
                if (
                    isinstance(stmt, ast.Assign)
                    and [ast.unparse(t) for t in stmt.targets] == ["result"]
                    and isinstance(stmt.value, ast.Dict)
                ):
                    return [ast.literal_eval(k) for k in stmt.value.keys if k is not None]
    raise KeyError(f"no 'result = {{...}}' in handler {handler}")


def parse_schema(sources: dict[str, str], version: str = SGLANG_PINNED) -> dict[str, Any]:
    """The fixture's content from the wheel's source texts."""
    classes: dict[str, Any] = {}
    for key, names in CLASSES.items():
        parsed = class_fields(sources[key])
        for name in names:
            if name not in parsed:
                raise KeyError(f"class {name} not found in {SOURCES[key]} of sglang {version}")
            classes[f"{key}.{name}"] = parsed[name]
    return {
        "sglang_version": version,
        "generated_by": "scripts/sglang_schema.py",
        "sources": SOURCES,
        "classes": classes,
        "responses": {
            f"{key}.{handler}": response_keys(sources[key], handler)
            for key, handlers in RESPONSES.items()
            for handler in handlers
        },
    }


def dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the fixture, write nothing")
    p.add_argument("--no-download", action="store_true", help="use only a cached wheel")
    p.add_argument("--version", default=SGLANG_PINNED)
    args = p.parse_args(argv)
    wheel = find_wheel(args.version, download=not args.no_download)
    if wheel is None:
        print(f"no sglang=={args.version} wheel in {cache_dir(args.version)}", file=sys.stderr)
        return 2
    text = dumps(parse_schema(read_sources(wheel), args.version))
    path = fixture_path(args.version)
    if args.check:
        same = path.exists() and path.read_text() == text
        print(f"{path}: {'up to date' if same else 'differs from ' + wheel.name}")
        return 0 if same else 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} from {wheel.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
