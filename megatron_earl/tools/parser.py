"""Tool-call parsing from model output, Hermes/Qwen format:

    some text <tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>

Parsing never raises on model output: every malformed block becomes a ``ToolResult`` with
``error=PARSE`` that the environment shows to the model as a tool response. Accepted: several
blocks per turn, whitespace around the JSON, ``arguments`` given as a JSON-encoded string
(some models emit it that way). Rejected, with a reason: invalid JSON, a JSON value that is not
an object, a missing/non-string ``name``, ``arguments`` that is not an object, an unclosed
``<tool_call>``, a stray ``</tool_call>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_earl.tools.base import ToolErrorKind, ToolResult

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call."""

    name: str
    """Tool name."""
    arguments: Any
    """Decoded arguments (checked against the tool's schema later)."""


@dataclass
class ParsedOutput:
    """A model turn split into free text, calls and parse errors (in order of appearance)."""

    content: str
    """The text outside the tool-call blocks, stripped."""
    calls: list[ToolCall | ToolResult] = field(default_factory=list)
    """Each block in order: a ``ToolCall``, or a ``ToolResult`` with ``error=PARSE``."""

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    @property
    def errors(self) -> list[ToolResult]:
        return [c for c in self.calls if isinstance(c, ToolResult)]


def _parse_block(body: str) -> ToolCall | ToolResult:
    def bad(reason: str) -> ToolResult:
        return ToolResult("", f"invalid tool call: {reason}", ToolErrorKind.PARSE)

    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return bad(f"not valid JSON ({e.msg} at char {e.pos}): {body.strip()[:80]!r}")
    if not isinstance(obj, dict):
        return bad(f'expected {{"name": ..., "arguments": {{...}}}}, got {type(obj).__name__}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return bad('missing "name" (a non-empty string)')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return bad(f'"arguments" of {name} is a string that is not JSON: {args[:80]!r}')
    if not isinstance(args, dict):
        return bad(f'"arguments" of {name} must be an object, got {type(args).__name__}')
    return ToolCall(name, args)


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split ``text`` into content and tool calls; malformed blocks become PARSE results."""
    calls: list[ToolCall | ToolResult] = []
    pieces: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        pieces.append(text[pos : m.start()])
        calls.append(_parse_block(m.group(1)))
        pos = m.end()
    rest = text[pos:]
    if OPEN in rest:
        calls.append(ToolResult("", f"invalid tool call: unclosed {OPEN}", ToolErrorKind.PARSE))
        rest = rest[: rest.index(OPEN)]
    content = "".join(pieces) + rest
    if CLOSE in content:
        calls.append(
            ToolResult("", f"invalid tool call: {CLOSE} without {OPEN}", ToolErrorKind.PARSE)
        )
        content = content.replace(CLOSE, "")
    return ParsedOutput(content.strip(), calls)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of a call (used by SFT demonstrations)."""
    return OPEN + json.dumps({"name": name, "arguments": arguments}) + CLOSE


def format_tool_responses(results: Sequence[ToolResult]) -> str:
    """Tool responses as the model sees them, one ``<tool_response>`` block per call."""
    return "".join(f"{RESPONSE_OPEN}{r.content}{RESPONSE_CLOSE}" for r in results)
