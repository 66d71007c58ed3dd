"""The ``calculator`` tool: arithmetic on numbers (+ - * / // % **, parentheses), no names, no calls."""

from __future__ import annotations

import ast
import operator

from posttrain import hookimpl

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}

_MAX_BITS = 10_000  # about 3,000 digits: past Python's int-to-text limit (4,300 digits) anyway


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 and (
                left.bit_length() * right > _MAX_BITS):  # (((9**64)**64)**64)**64 would take a minute
            raise ValueError("result too large")
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) and (
                left.bit_length() + right.bit_length() > _MAX_BITS):
            raise ValueError("result too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic ``expression`` such as ``"(2 + 3) * 4"``; returns the result as text."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    value = _eval(ast.parse(expression, mode="eval"))
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


@hookimpl
def posttrain_register_tools(registry):
    registry.add(calculator, name="calculator")
