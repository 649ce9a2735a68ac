"""The package's import graph (every ``import`` of a ``megatron_earl`` module, at module level or
inside a function): the benchmarks live beside the library, never in it. Nothing outside
``megatron_earl/bench/`` imports it except the command table of ``cli/main.py`` (by module
name, resolved when a ``bench`` command runs), so the trainer never loads a benchmark."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_earl"


def _imports(path: Path) -> set[str]:
    """Every ``megatron_earl...`` module ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megatron_earl"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("megatron_earl"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _module_strings(path: Path) -> set[str]:
    """String constants naming a ``megatron_earl`` module (``importlib`` targets)."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("megatron_earl.bench")
    }


def test_nothing_in_the_library_imports_the_benchmarks():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("bench/"):
            continue
        bench = sorted(m for m in _imports(path) if m.split(".")[:2] == ["megatron_earl", "bench"])
        if rel != "cli/main.py":
            bench += sorted(_module_strings(path))
        if bench:
            offenders[rel] = bench
    assert not offenders, f"library modules that import megatron_earl.bench: {offenders}"


def test_benchmark_files_live_only_in_the_benchmark_package():
    stray = sorted(
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if not p.relative_to(PACKAGE).as_posix().startswith("bench/")
        and (
            p.stem.startswith(("bench", "peer_"))
            or p.stem in ("bench", "pipeline_sim", "fault_suite")
        )
    )
    assert not stray, f"benchmark, simulator or peer-harness files outside bench/: {stray}"
