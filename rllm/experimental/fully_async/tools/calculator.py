"""The built-in calculator tool: safe arithmetic on a string, with no `eval` (standard library only, so a worker
imports it in milliseconds)."""

from __future__ import annotations

import ast
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % **, parentheses, integers and decimals); never `eval`.

    Integral results print without a decimal point ("408", not "408.0"). Exponents above 64 are refused so a
    call cannot make the worker compute a gigantic number.
    """

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError(f"exponent {right} is too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)
