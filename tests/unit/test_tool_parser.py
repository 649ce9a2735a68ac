"""Tool-call parsing (Hermes/Qwen ``<tool_call>{json}</tool_call>``), schema validation and the
tool API's error handling: malformed input becomes a result for the model, never an exception.

Run: python -m pytest -q -p no:warnings tests/unit/test_tool_parser.py
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from megatron_earl.tools import (
    TOOLS,
    Calculator,
    Tool,
    ToolCall,
    ToolErrorKind,
    invoke,
    invoke_by_name,
    parse_tool_calls,
)
from megatron_earl.tools.calculator import evaluate
from megatron_earl.tools.parser import format_tool_call, format_tool_responses
from megatron_earl.tools.registry import normalize_spec


def test_single_call_and_content():
    call = '{"name": "calculator", "arguments": {"expression": "3+4"}}'
    text = f"Let me compute. <tool_call>\n{call}\n</tool_call>"
    out = parse_tool_calls(text)
    assert out.content == "Let me compute."
    assert out.calls == [ToolCall("calculator", {"expression": "3+4"})]
    assert not out.errors


def test_several_calls_keep_order_and_string_arguments():
    text = (
        format_tool_call("a", {"x": 1})
        + " mid "
        + '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    out = parse_tool_calls(text)
    assert out.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})]
    assert out.content == "mid"


def test_no_call_is_plain_content():
    out = parse_tool_calls("  42 ")
    assert out.content == "42" and not out.has_calls


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "calculator", "arguments": ', "not valid JSON"),
        ("[1, 2]", "got list"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": "", "arguments": {}}', 'missing "name"'),
        ('{"name": "c", "arguments": [1]}', '"arguments" of c must be an object'),
        ('{"name": "c", "arguments": "not json"}', "is a string that is not JSON"),
    ],
)
def test_malformed_blocks_become_parse_errors(body, message):
    out = parse_tool_calls(f"x <tool_call>{body}</tool_call>")
    (err,) = out.errors
    assert err.error is ToolErrorKind.PARSE and message in err.content
    assert out.content == "x"


def test_unclosed_and_stray_tags():
    out = parse_tool_calls('ok <tool_call>{"name": "c"')
    assert [e.content for e in out.errors] == ["invalid tool call: unclosed <tool_call>"]
    assert out.content == "ok"
    out = parse_tool_calls("ok </tool_call>")
    assert "without <tool_call>" in out.errors[0].content and out.content == "ok"


def test_openai_spec_shape_and_schema_validation():
    calc = Calculator()
    spec = calc.spec()
    assert spec["type"] == "function" and spec["function"]["name"] == "calculator"
    assert spec["function"]["parameters"]["required"] == ["expression"]
    assert calc.validate({"expression": "1+1"}) is None
    assert "'expression' is a required property" in calc.validate({})
    assert "expression: 3 is not of type 'string'" == calc.validate({"expression": 3})
    assert "Additional properties" in calc.validate({"expression": "1", "x": 2})


class _Sleepy(Tool):
    name = "sleepy"
    description = "sleeps"
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # noqa: RUF012

    async def execute(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(10)
        return "late"


class _Broken(Tool):
    name = "broken"
    description = "raises"
    parameters: dict[str, Any] = {"type": "object"}  # noqa: RUF012

    async def execute(self, arguments: dict[str, Any]) -> str:
        raise RuntimeError("boom")


def test_invoke_turns_failures_into_results():
    async def go():
        calc = Calculator()
        ok = await invoke(calc, {"expression": "3+4*2"})
        bad_args = await invoke(calc, {"expr": "1"})
        unknown = await invoke_by_name({"calculator": calc}, "abacus", {})
        timeout = await invoke(_Sleepy(timeout_s=0.05), {})
        broken = await invoke(_Broken(), {})
        return ok, bad_args, unknown, timeout, broken

    ok, bad_args, unknown, timeout, broken = asyncio.run(go())
    assert ok.ok and ok.content == "11"
    assert bad_args.error is ToolErrorKind.INVALID_ARGUMENTS
    assert unknown.error is ToolErrorKind.UNKNOWN_TOOL and "['calculator']" in unknown.content
    assert timeout.error is ToolErrorKind.TIMEOUT and "0.05s" in timeout.content
    assert broken.error is ToolErrorKind.ERROR and "RuntimeError: boom" in broken.content
    assert format_tool_responses([ok, broken]) == (
        "<tool_response>11</tool_response><tool_response>broken failed: RuntimeError: boom"
        "</tool_response>"
    )


def test_calculator_is_safe():
    assert evaluate("2*(3+4)-5//2") == 12
    for bad in ("__import__('os')", "2**1000", "1/0", "x+1", "9" * 300):
        with pytest.raises(ValueError):
            evaluate(bad)
    result = asyncio.run(invoke(Calculator(), {"expression": "1/0"}))
    assert result.ok and result.content == "error: division by zero"


def test_registry_specs():
    assert isinstance(TOOLS.build("calculator"), Calculator)
    assert isinstance(TOOLS.build("megatron_earl.tools.calculator:Calculator"), Calculator)
    assert TOOLS.build({"name": "calculator", "kwargs": {"timeout_s": 2}}).timeout_s == 2
    assert normalize_spec({"name": "x", "args": {"a": 1}}) == ("x", {"a": 1})
    with pytest.raises(KeyError, match=r"unknown tool 'nope'; registered: .*calculator"):
        TOOLS.build("nope")
    with pytest.raises(ValueError, match="unknown keys"):
        normalize_spec({"name": "x", "kwarg": {}})
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        TOOLS.build("megatron_earl.tools.calculator:Nope")
