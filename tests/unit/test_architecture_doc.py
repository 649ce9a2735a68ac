"""docs/architecture.md's step walk matches the code: every ``file::name`` it cites is a file under
``megatron_earl/`` (or the top-level ``patches/``) defining ``name`` (a function, a class, or a
``Class.method``), and every bare ``Class.method`` it cites is defined by a class of that name.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "megatron_earl" / "docs" / "architecture.md"
QUALIFIED = re.compile(r"`?([\w/]+\.py)::([\w.]+)`?")
BARE_METHOD = re.compile(r"`([A-Z]\w+)\.(\w+)`")


@cache
def definitions(path: Path) -> frozenset[str]:
    """Top-level functions and classes of ``path``, plus ``Class.method`` for their methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
    return frozenset(names)


def source_file(rel: str) -> Path:
    if rel.startswith("patches/"):
        return ROOT / rel
    return ROOT / "megatron_earl" / rel


def test_every_cited_file_and_function_exists():
    text = DOC.read_text()
    cited = QUALIFIED.findall(text)
    assert len(cited) >= 15, "the step walk should cite the code it describes"
    missing = []
    for rel, name in cited:
        path = source_file(rel)
        if not path.is_file():
            missing.append(f"{rel} (no such file)")
        elif name not in definitions(path):
            missing.append(f"{rel}::{name}")
    assert not missing, f"docs/architecture.md cites what the code does not define: {missing}"


def test_every_cited_method_exists_on_a_class_of_that_name():
    methods = set()
    for path in [*(ROOT / "megatron_earl").rglob("*.py"), *(ROOT / "patches").rglob("*.py")]:
        methods |= {n for n in definitions(path) if "." in n}
    text = QUALIFIED.sub("", DOC.read_text())
    cited = {f"{cls}.{name}" for cls, name in BARE_METHOD.findall(text)}
    assert cited, "the step walk should name the loop's methods"
    assert not cited - methods, f"no class defines {sorted(cited - methods)}"


def test_the_walk_fits_on_a_page():
    assert len(DOC.read_text().splitlines()) <= 60
