"""Reading the final answer out of a model's reply, and checking it against the target."""

import re
from decimal import Decimal, InvalidOperation

# A number as written in prose: optional minus (not one between operands, as in "5-3"), digits with optional
# thousands commas, optional decimals.
NUMBER = r"(?<![\w)])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER = re.compile(NUMBER)
_HASHES = re.compile(r"####\s*\$?\s*(" + NUMBER + ")")
_BOXED = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")


def parse_number(text: str) -> Decimal | None:
    """``text`` as a number (thousands commas and surrounding spaces allowed), or None."""
    try:
        value = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def parse_final_answer(reply: str) -> Decimal | None:
    """The reply's final answer, or None if it holds no number.

    In order of preference: the number after the last ``#### ``, the first number inside the last ``\\boxed{...}``,
    the last number anywhere in the reply. Unicode minus signs count as ``-``.
    """
    reply = reply.replace("\u2212", "-")
    if hashes := _HASHES.findall(reply):
        return parse_number(hashes[-1])
    for boxed in reversed(_BOXED.findall(reply)):
        if number := _NUMBER.search(boxed.replace("\\,", "").replace("\\!", "")):
            return parse_number(number.group())
    numbers = _NUMBER.findall(reply)
    return parse_number(numbers[-1]) if numbers else None


def is_correct(reply: str, target: str) -> bool:
    """Whether the reply's final answer equals ``target`` as a number (``"42.0"`` equals ``"42"``)."""
    answer, expected = parse_final_answer(reply), parse_number(target)
    return answer is not None and expected is not None and answer == expected


def canonical_number(value: Decimal | int) -> str:
    """The shortest plain spelling of a number: ``Decimal("1,200.50")`` gives ``"1200.5"``, ``42.0`` gives ``"42"``."""
    value = Decimal(value)
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


__all__ = ["canonical_number", "is_correct", "parse_final_answer", "parse_number"]
