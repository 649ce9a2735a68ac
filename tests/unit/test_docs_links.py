"""Every relative link of README.md and megatron_earl/docs/**/*.md resolves: the file or folder
exists, and a ``#fragment`` into a Markdown file names one of its headings (GitHub's anchors)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "megatron_earl" / "docs").rglob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    text = FENCE.sub("", path.read_text())
    return frozenset(
        _anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")
    )


def test_anchor_matches_github():
    assert _anchor("Benchmark: `megatron-earl bench engine` (`bench/engine.py`)") == (
        "benchmark-megatron-earl-bench-engine-benchenginepy"
    )
    assert _anchor("Probes: where a step's time goes") == "probes-where-a-steps-time-goes"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{path.relative_to(ROOT)}: broken links {broken}"
