"""Docs and docstrings state what is true today; the history of how it came to be lives in git.

README.md, every Markdown file under ``megatron_earl/docs/`` and every comment and string literal
(docstrings included) of the Python files under ``megatron_earl/`` and ``patches/`` must not
narrate work periods ("the ninth session", "this session", "the third time we tried", "before
this wave"). Figures go in dated tables under ``megatron_earl/docs/measurements/``, each with the
command and commit that printed it. And the README stays a front door: at most 160 lines.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 160

_ORDINAL = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    r"\d+(?:st|nd|rd|th)"
)
_PHRASES = (
    rf"\b(?:{_ORDINAL}) (?:work )?session\b"  # "the ninth session", "12th work session"
    r"|\b(?:this|earlier|previous) session\b"
    r"|\bsession \d+\b"  # "session 11"
    r"|\bwork periods?\b"
    rf"|\b(?:{_ORDINAL}|next|last) time (?:we|I)\b"  # "the third time we tried"
    r"|\b(?:this|that|the previous|the last) wave\b"  # "before this wave's engine"
)
# A space in a phrase matches any whitespace: a phrase wrapped over two lines still matches.
NARRATION = re.compile(_PHRASES.replace(" ", r"\s+"), re.IGNORECASE)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "megatron_earl" / "docs").rglob("*.md"))]


def _python_files() -> list[Path]:
    return sorted([*(ROOT / "megatron_earl").rglob("*.py"), *(ROOT / "patches").rglob("*.py")])


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of ``path``: docstrings, comments and
    messages are where narration would hide; code is not prose."""
    prose = {
        tokenize.COMMENT,
        tokenize.STRING,
        getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING),
    }
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type in prose]


def _hits(text: str, first_line: int = 1) -> list[str]:
    """Every narrating phrase of ``text`` with its line (``text`` starts at ``first_line``)."""
    hits = []
    for match in NARRATION.finditer(text):
        line = first_line + text.count("\n", 0, match.start())
        hits.append(f"line {line}: {' '.join(match.group(0).split())!r}")
    return hits


def test_the_pattern_catches_narration_and_spares_plain_statements():
    for narrated in [
        "**Twelfth session, 2026-11-27**: the prefill ...",
        "measured (docs/engines.md, ninth\n    session)",
        "as in the 7th session",
        "numbers from this session",
        "the earlier session's run of this sweep",
        "the third time we tried it",
        "Before this wave's engine",
    ]:
        assert _hits(narrated), narrated
    for plain in [
        "a request with a session goes to the engine that served the session before",
        "the session's next turn takes the parked row over",
        "aiohttp.ClientSession() as session",
        "the first time a rank sees the layout, it builds the groups",
        "every prompt is prefilled once at the first step",
    ]:
        assert not _hits(plain), plain


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_do_not_narrate_work_periods(path: Path):
    hits = _hits(path.read_text())
    assert not hits, (
        f"{path.relative_to(ROOT)} narrates work periods {hits}: state what is true today and "
        "why; put figures in megatron_earl/docs/measurements/ with date, command and commit"
    )


def test_code_comments_and_docstrings_do_not_narrate_work_periods():
    found = []
    for path in _python_files():
        for line, text in _python_prose(path):
            found += [f"{path.relative_to(ROOT)} {hit}" for hit in _hits(text, line)]
    assert not found, f"comments or docstrings narrate work periods: {found}"


def test_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference material to "
        "megatron_earl/docs/ and measurement history to megatron_earl/docs/measurements/"
    )
