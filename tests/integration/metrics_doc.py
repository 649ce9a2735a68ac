"""The metrics contract of ``megatron_earl/docs/metrics.md``: the table under "Keys the RL loop
writes" lists every key with the condition under which the loop emits it (``always``, ``eval``,
``selector``, ``sglang``, ``colocated``, ``reshard``, ``async``, ``repack``: ``rollout.repack``
drain or repack, ``dynamic_sampling`` and ``async_dynamic_sampling``: ``rollout.dynamic_sampling``
in the synchronous loop and in async mode; ``routing_measure``: an MoE run whose ``routing``
records routes and has a forward that does not replay them).
``check_documented(records, conditions)`` asserts, for one run's metrics records, that every
emitted key matches a documented key and every documented key of the run's conditions is
emitted. The trainer's integration tests call it on the runs they make anyway.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "megatron_earl" / "docs" / "metrics.md"
CONDITIONS = (
    "always",
    "eval",
    "selector",
    "sglang",
    "colocated",
    "reshard",
    "async",
    "repack",
    "dynamic_sampling",
    "async_dynamic_sampling",
    "routing_measure",
)
PLACEHOLDERS = {"<phase>": r"[a-z_]+", "<i>": r"\d+"}


def documented() -> list[tuple[str, str, re.Pattern]]:
    """(key, condition, pattern) of every documented key, in table order."""
    text = DOC.read_text()
    section = text[text.index("## Keys the RL loop writes") :]
    section = section[: section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        when = cells[3]
        assert when in CONDITIONS, f"metrics.md row {cells[0]}: when={when!r}; valid: {CONDITIONS}"
        for key in re.findall(r"`([^`]+)`", cells[0]):
            pattern = re.escape(key)
            for placeholder, regex in PLACEHOLDERS.items():
                pattern = pattern.replace(re.escape(placeholder), regex)
            rows.append((key, when, re.compile(pattern + r"\Z")))
    return rows


def check_documented(records: list[dict], conditions: set[str]) -> None:
    """Every key of ``records`` is documented; every key documented under ``conditions`` (plus
    ``always``) appears in ``records``."""
    rows = documented()
    emitted = set().union(*records)
    undocumented = sorted(k for k in emitted if not any(p.match(k) for _, _, p in rows))
    assert not undocumented, f"emitted but not in docs/metrics.md: {undocumented}"
    expected = {"always", *conditions}
    missing = [
        key for key, when, p in rows if when in expected and not any(p.match(k) for k in emitted)
    ]
    assert not missing, f"in docs/metrics.md ({sorted(expected)}) but never emitted: {missing}"
