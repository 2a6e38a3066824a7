"""The built-in `calculator` tool: arithmetic walked with `ast` (numbers, `+ - * / // % **`, parentheses), no
`eval`, with bounds on exponents and result size."""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["calculator", "evaluate_arithmetic"]

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_POW = 1000  # largest exponent magnitude
_MAX_DIGITS = 4000  # largest integer result, in decimal digits


def _eval_node(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POW:
            raise ValueError(f"exponent {right} too large (limit {_MAX_POW})")
        out = _BINOPS[type(node.op)](left, right)
        if isinstance(out, int) and out.bit_length() > _MAX_DIGITS * 3.33:
            raise ValueError(f"result has more than {_MAX_DIGITS} digits")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval_node(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}; use numbers, + - * / // % ** ( )")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: an arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "12*(3+4)"
    """
    try:
        return str(evaluate_arithmetic(expression))
    except (ValueError, ArithmeticError) as e:  # the model's mistake: an observation, not a tool failure
        return f"Error: {e}"


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic `expression` (numbers, + - * / // % ** and parentheses), walked with `ast`
    (no `eval`): integral floats under 1e15 come back as ints. Raises ValueError for anything else (names,
    calls, attributes...), an exponent over 1000, a result over 4000 digits or not finite; ZeroDivisionError."""
    try:
        tree = ast.parse(str(expression).strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None
    value = _eval_node(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"result is not finite: {value}")
        if value.is_integer() and abs(value) < 1e15:
            value = int(value)
    return value
