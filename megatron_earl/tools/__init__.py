"""Tools for agentic rollouts: the tool API (``Tool``, ``invoke``), its registry (``TOOLS``),
Hermes/Qwen tool-call parsing, and the built-in ``calculator`` and sandboxed ``python`` tools."""

from __future__ import annotations

from megatron_earl.tools.base import TOOLS, Tool, ToolErrorKind, ToolResult, invoke, invoke_by_name
from megatron_earl.tools.calculator import Calculator
from megatron_earl.tools.parser import ParsedOutput, ToolCall, parse_tool_calls
from megatron_earl.tools.sandbox import (
    PythonTool,
    SandboxBackend,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    run_python,
    sandbox_backend,
)

__all__ = [
    "TOOLS",
    "Calculator",
    "ParsedOutput",
    "PythonTool",
    "SandboxBackend",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailableError",
    "Tool",
    "ToolCall",
    "ToolErrorKind",
    "ToolResult",
    "invoke",
    "invoke_by_name",
    "parse_tool_calls",
    "run_python",
    "sandbox_backend",
]
