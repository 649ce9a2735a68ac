"""docs/reliability.md's fault table names real tests: every ``dir/test_file.py::test_name`` it
cites is a test function defined in that file under ``tests/``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "megatron_earl" / "docs" / "reliability.md"
CITED = re.compile(r"`((?:unit|integration|distributed)/test_\w+\.py)::(test_\w+)`")


def _tests(path: Path) -> set[str]:
    return {
        node.name
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
    }


def test_every_cited_test_exists():
    cited = set(CITED.findall(DOC.read_text()))
    assert len(cited) >= 40, "the fault table should name the tests that cover each fault"
    missing = [
        f"{rel}::{name}"
        for rel, name in sorted(cited)
        if not (ROOT / "tests" / rel).is_file() or name not in _tests(ROOT / "tests" / rel)
    ]
    assert not missing, f"docs/reliability.md cites tests that do not exist: {missing}"
