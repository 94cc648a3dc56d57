"""The calculator tool: arithmetic over Python's ``ast``, safe on model-written input.

Only numbers, ``+ - * / // % **``, unary ``+``/``-`` and parentheses are evaluated; any other syntax is refused
with a one-line message the model can act on. Input length and every intermediate result are bounded, and powers
are checked before they are computed, so no expression can hang the process or exhaust its memory.
"""

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 200
"""Longest expression accepted."""
MAX_MAGNITUDE = 10**15
"""Largest absolute value of any number or intermediate result (floats are exact integers up to here)."""

Number = int | float

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
_REFUSALS = {
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "indexing is not allowed",
    ast.Tuple: "commas are not allowed (write 1000, not 1,000)",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "'and'/'or' are not allowed",
}
ALLOWED = "numbers, + - * / // % **, and parentheses"


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is meant for the model."""


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression``; raises :class:`CalculatorError` for anything else."""
    expression = expression.strip()
    if not expression:
        raise CalculatorError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long: {len(expression)} characters, at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalculatorError(f"not a valid expression: {expression!r} (allowed: {ALLOWED})") from None
    return _eval(tree.body)


def format_number(value: Number) -> str:
    """``value`` as the model reads it: integers without ``.0``, other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".12g")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value, e.g. "(12 + 8) * 3 / 4" -> "15".
    Supports numbers, + - * / // % ** (power) and parentheses; no variables, functions or units."""
    return format_number(evaluate(expression))


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"result too large (limit {MAX_MAGNITUDE:.0e})") from None
        if isinstance(result, complex):
            raise CalculatorError("result is not a real number (fractional power of a negative number)")
        return _bounded(result)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("'^' is not supported: write powers with '**'")
    reason = _REFUSALS.get(type(node), f"{type(node).__name__} is not allowed")
    raise CalculatorError(f"{reason} (allowed: {ALLOWED})")


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse a power whose result would exceed MAX_MAGNITUDE, before computing it.

    Only ``|base| > 1`` with a positive exponent grows; other powers stay within [-1, 1] in magnitude or are
    cheap (0, 1 and -1 to any integer power take a few multiplications).
    """
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError(f"result too large: {base} ** {exponent} exceeds the limit {MAX_MAGNITUDE:.0e}")


def _bounded(value: Number) -> Number:
    if isinstance(value, float) and math.isnan(value):
        raise CalculatorError("result is not a number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"number too large (limit {MAX_MAGNITUDE:.0e})")
    return value


__all__ = ["CalculatorError", "calculator", "evaluate", "format_number"]
