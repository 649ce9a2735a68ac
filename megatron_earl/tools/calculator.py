"""The calculator tool: evaluates an arithmetic expression safely (``ast``, no ``eval``).

Supports integers and decimals, ``+ - * / // % **`` and parentheses, unary +/-. Guards: at most
200 characters, exponents <= 64, results of at most 10**30 in magnitude; anything else is an
error message for the model. Integral results print without a decimal point (``7`` not ``7.0``).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from megatron_earl.tools.base import TOOLS, Tool

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_CHARS, MAX_EXPONENT, MAX_MAGNITUDE = 200, 64, 10**30


def evaluate(expression: str) -> int | float:
    """Value of an arithmetic expression; raises ``ValueError`` naming what is not allowed."""
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} larger than {MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            value = _UNARY[type(node.op)](ev(node.operand))
        else:
            raise ValueError(
                f"{type(node).__name__} is not allowed (only numbers, + - * / // % **)"
            )
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value

    try:
        return ev(tree.body)
    except ZeroDivisionError as e:
        raise ValueError("division by zero") from e


def format_number(value: int | float) -> str:
    """``7`` for integral values, else up to 6 significant decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


@TOOLS.register("calculator")
class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    parameters: dict[str, Any] = {  # noqa: RUF012
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 3+4*2"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def execute(self, arguments: dict[str, Any]) -> str:
        try:
            return format_number(evaluate(arguments["expression"]))
        except ValueError as e:
            return f"error: {e}"
