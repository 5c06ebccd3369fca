"""The built-in `calculator` tool: arithmetic on numbers, evaluated without `eval`."""

from __future__ import annotations

import ast
import operator

__all__ = ["calculator"]

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
_LARGEST = 10**12


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "(12 + 3) * 4".

    Args:
        expression: the expression to evaluate.

    Returns:
        The value, as an integer when it is one.
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError("only numbers, + - * / and parentheses are allowed")
    if abs(value) > _LARGEST:
        raise ValueError(f"a value beyond {_LARGEST:.0e}")
    return value
