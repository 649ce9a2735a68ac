"""The package's import graph (every ``import`` of a ``megatron_earl`` module, at module level or
inside a function): the benchmarks live beside the library, never in it. Nothing outside
``megatron_earl/bench/`` imports it except the command table of ``cli/main.py`` (by module
name, resolved when a ``bench`` command runs), so the trainer never loads a benchmark. And the
graph has no cycle (``test_no_import_cycle``; there, imports under ``if TYPE_CHECKING:`` are left
out: they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_earl"
PATCHES = PACKAGE.parent / "patches"
"""The repository's top-level ``patches/``: the ``megatron_earl.patches`` package at run time."""


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


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its ``else`` counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _module_files(package: Path, name: str | None = None) -> dict[str, Path]:
    """{dotted module name: file} of every ``.py`` file under ``package`` (a package by its
    ``__init__.py``), named from ``name`` (default: the directory's name)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join([name or package.name, *parts])] = path
    return modules


def _runtime_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports at run time: every ``import`` /
    ``from ... import`` in the file, at module level or inside a function, except under ``if
    TYPE_CHECKING:``; ``from pkg import x`` imports ``pkg`` and, when it is a module, ``pkg.x``;
    relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def _import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The strongly connected components of more than one module of the run-time import graph
    of ``modules`` (``_runtime_imports``), each sorted, in order."""
    graph = {name: _runtime_imports(name, path, modules) for name, path in modules.items()}

    def reach(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reachable = {name: reach(name) for name in graph}
    cycles = {tuple(sorted(m for m in reachable[name] if name in reachable[m])) for name in graph}
    return sorted(list(c) for c in cycles if len(c) > 1)


def test_no_import_cycle():
    """No two modules of ``megatron_earl`` import each other, directly or through others
    (STYLE.md habit 14). The graph holds every import of a ``megatron_earl`` module anywhere in a
    file -- at module level and inside functions, so a function-level import does not hide a
    cycle -- with ``from pkg import name`` an edge to ``pkg`` and, when it is a module, to
    ``pkg.name``. Imports under ``if TYPE_CHECKING:`` are excluded explicitly: they never run, so
    an annotation-only type (a Protocol, say) may point back up the layers. The repository's
    ``patches/`` counts as ``megatron_earl.patches`` (``megatron_earl/__init__.py`` loads it so)."""
    modules = _module_files(PACKAGE) | _module_files(PATCHES, "megatron_earl.patches")
    cycles = _import_cycles(modules)
    report = "\n".join(f"  {len(c)} modules: {', '.join(c)}" for c in cycles)
    assert not cycles, f"import cycles (strongly connected components):\n{report}"


def test_cycle_finder_counts_function_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.sub import leaf\n",
        "sub/__init__.py": "",
        "sub/leaf.py": "def f():\n    import pkg.top\n",  # function level: counted
        "top.py": "from .sub import leaf\n",  # relative: counted
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.typed2\n",
        "typed2.py": "from pkg import typed\n",  # back up only under TYPE_CHECKING: no cycle
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    assert _import_cycles(_module_files(pkg)) == [["pkg.sub.leaf", "pkg.top"]]


LAYERS = (
    ("config", "compat", "tokenizer"),
    ("device_policy", "emulated_device", "emulated_copies", "emulated_syncs", "parallel",
     "runtime", "patches", "models", "dispatch", "redistribute", "training", "convert",
     "selector", "envs", "tools", "rewards", "testing"),
    ("rollout",),
    ("orchestration",),
    ("cli", "bench"),
)  # fmt: skip
"""docs/architecture.md's layers, bottom first: a module imports only from its own layer or
below. ``rollout`` covers its subpackages (``agent``, ``embedded``, ``serve``, ``sglang``,
``weights`` with the relay service under it)."""


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for depth, names in enumerate(LAYERS):
        if top in names:
            return depth
    raise AssertionError(f"{module} is in no layer of docs/architecture.md: add it to LAYERS")


def test_imports_point_down_the_layers_of_the_architecture_doc():
    """Every run-time import (``_runtime_imports``) goes to the importer's layer or a lower one;
    the layer names are the ones ``docs/architecture.md`` draws; ``config/`` imports nothing else
    of the project (STYLE.md habit 11); ``rollout/agent/`` reaches the engines only through the
    engine protocol (``rollout/engine.py``)."""
    modules = _module_files(PACKAGE) | _module_files(PATCHES, "megatron_earl.patches")
    doc = (PACKAGE / "docs" / "architecture.md").read_text()
    missing = [name for names in LAYERS for name in names if f"`{name}`" not in doc]
    assert not missing, f"layers not named in docs/architecture.md: {missing}"
    upward, config_out, agent_out = [], [], []
    for name, path in sorted(modules.items()):
        if name == "megatron_earl":
            continue
        for dep in sorted(_runtime_imports(name, path, modules)):
            if dep == "megatron_earl":
                continue
            if _layer(dep) > _layer(name):
                upward.append(f"{name} -> {dep}")
            if name.startswith("megatron_earl.config") and not dep.startswith(
                "megatron_earl.config"
            ):
                config_out.append(f"{name} -> {dep}")
            rollout_dep = dep.startswith("megatron_earl.rollout.") and not dep.startswith(
                ("megatron_earl.rollout.agent", "megatron_earl.rollout.engine")
            )
            if name.startswith("megatron_earl.rollout.agent") and rollout_dep:
                agent_out.append(f"{name} -> {dep}")
    assert not upward, "imports up the layers:\n  " + "\n  ".join(upward)
    assert not config_out, "config/ imports other project modules:\n  " + "\n  ".join(config_out)
    assert not agent_out, "rollout/agent/ past the engine protocol:\n  " + "\n  ".join(agent_out)
