"""The tool API: a name, JSON-schema parameters (OpenAI function-calling shape) and an async call
with a timeout. ``invoke`` turns every failure into a ``ToolResult`` the model can read.

    @TOOLS.register("calculator")
    class Calculator(Tool):
        name = "calculator"
        description = "Evaluate an arithmetic expression."
        parameters = {"type": "object", "properties": {"expression": {"type": "string"}},
                      "required": ["expression"], "additionalProperties": False}

        async def execute(self, arguments: dict) -> str:
            ...

Arguments are validated against ``parameters`` with ``jsonschema`` before ``execute`` runs.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jsonschema

from megatron_earl.tools.registry import Registry


class ToolErrorKind(str, enum.Enum):
    """Why a tool call did not produce a normal result."""

    PARSE = "parse_error"
    """The ``<tool_call>`` block was not valid JSON / not ``{"name", "arguments"}``."""
    UNKNOWN_TOOL = "unknown_tool"
    """No tool of that name is available to this environment."""
    INVALID_ARGUMENTS = "invalid_arguments"
    """The arguments failed the tool's JSON schema."""
    TIMEOUT = "timeout"
    """The call ran past the tool's ``timeout_s``."""
    ERROR = "error"
    """The tool raised."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returned, as text for the model."""

    name: str
    """Tool name as the model wrote it."""
    content: str
    """Result text (or the error message shown to the model)."""
    error: ToolErrorKind | None = None
    """None on success."""

    @property
    def ok(self) -> bool:
        return self.error is None


class Tool(ABC):
    """A callable tool. Subclasses set the class attributes and implement ``execute``."""

    name: ClassVar[str]
    """Name the model calls the tool by."""
    description: ClassVar[str]
    """One-line description shown to the model."""
    parameters: ClassVar[dict[str, Any]]
    """JSON schema (type object) of the arguments."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._validator = _validator(type(self))

    def spec(self) -> dict[str, Any]:
        """The OpenAI function-calling description of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, arguments: Any) -> str | None:
        """None when ``arguments`` satisfies the schema, else a one-line reason."""
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path) or "arguments"
        return f"{where}: {error.message}"

    @abstractmethod
    async def execute(self, arguments: dict[str, Any]) -> str:
        """Run the tool on schema-valid arguments; return the result text."""


@functools.cache
def _validator(tool_class: type[Tool]) -> jsonschema.Draft202012Validator:
    """The checked argument validator of a tool class, built once per class (an environment
    builds its tools per trajectory; checking a schema costs milliseconds)."""
    jsonschema.Draft202012Validator.check_schema(tool_class.parameters)
    return jsonschema.Draft202012Validator(tool_class.parameters)


TOOLS: Registry[Tool] = Registry("tool")
"""Registry of tool classes by name."""


async def invoke(tool: Tool, arguments: Any) -> ToolResult:
    """Validate, run with the tool's timeout, and convert every failure into a ``ToolResult``."""
    reason = tool.validate(arguments)
    if reason is not None:
        return ToolResult(
            tool.name,
            f"invalid arguments for {tool.name}: {reason}",
            ToolErrorKind.INVALID_ARGUMENTS,
        )
    try:
        content = await asyncio.wait_for(tool.execute(arguments), tool.timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(
            tool.name, f"{tool.name} timed out after {tool.timeout_s:g}s", ToolErrorKind.TIMEOUT
        )
    except Exception as e:  # a tool bug must not kill the trajectory: the model sees it
        return ToolResult(
            tool.name, f"{tool.name} failed: {type(e).__name__}: {e}", ToolErrorKind.ERROR
        )
    if not isinstance(content, str):
        content = json.dumps(content, default=str)
    return ToolResult(tool.name, content)


async def invoke_by_name(tools: Mapping[str, Tool], name: str, arguments: Any) -> ToolResult:
    """``invoke`` the named tool; an unknown name becomes an ``UNKNOWN_TOOL`` result."""
    tool = tools.get(name)
    if tool is None:
        return ToolResult(
            name, f"unknown tool {name!r}; available: {sorted(tools)}", ToolErrorKind.UNKNOWN_TOOL
        )
    return await invoke(tool, arguments)


def tool_map(tools: Sequence[Tool]) -> dict[str, Tool]:
    """``{name: tool}``; raises naming the duplicate when two tools share a name."""
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out
