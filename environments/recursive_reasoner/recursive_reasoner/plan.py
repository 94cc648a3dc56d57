"""The planner's reply: one JSON object ``{"should_decompose", "subproblems", "plan"}``, or malformed.

A reply is read after dropping its thinking (everything up to the last ``</think>``, and an unclosed ``<think>`` to
the end). What is left must be a JSON object, alone or in a fenced code block (```` ```json ... ``` ````), with:

- ``should_decompose``: a JSON boolean;
- ``subproblems``: a list of non-empty strings, 2 to ``max_subproblems`` of them when ``should_decompose`` is true,
  none when it is false;
- ``plan``: a string (may be empty): how to combine the subproblems' answers, or how to solve the problem directly.

Other keys are ignored. Anything else is malformed: :func:`parse_plan` raises :class:`MalformedPlan` saying why.
"""

import json
import re

from pydantic import BaseModel, ConfigDict

MIN_SUBPROBLEMS = 2
_FENCED = re.compile(r"```(?:json)?[ \t]*\n?(.*?)```", re.DOTALL)
_FIELDS: dict[str, tuple[type, str]] = {
    "should_decompose": (bool, "a boolean"),
    "subproblems": (list, "a list of strings"),
    "plan": (str, "a string"),
}


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)

    should_decompose: bool
    subproblems: tuple[str, ...] = ()
    """Stripped of surrounding whitespace; empty when should_decompose is false."""
    plan: str = ""


class MalformedPlan(ValueError):
    """A planner reply that is not a valid plan; the message says why."""


def strip_thinking(reply: str) -> str:
    """The reply without thinking: what follows the last ``</think>``, cut at an unclosed ``<think>``."""
    return reply.rpartition("</think>")[2].partition("<think>")[0].strip()


def _json_object(text: str) -> dict:
    for candidate in (text, *_FENCED.findall(text)):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict):
            raise MalformedPlan(f"expected a JSON object, got a JSON {type(value).__name__}")
        return value
    raise MalformedPlan("no JSON object in the reply")


def parse_plan(reply: str, max_subproblems: int) -> Plan:
    """The plan in the planner's ``reply``; raises :class:`MalformedPlan` when there is none (see the module)."""
    value = _json_object(strip_thinking(reply))
    for key, (kind, expected) in _FIELDS.items():
        if key not in value:
            raise MalformedPlan(f"missing key {key!r}")
        if not isinstance(value[key], kind):
            raise MalformedPlan(f"{key!r} must be {expected}, got {json.dumps(value[key])[:40]}")
    subproblems = value["subproblems"]
    if not all(isinstance(s, str) and s.strip() for s in subproblems):
        raise MalformedPlan("'subproblems' must hold non-empty strings only")
    if value["should_decompose"] and not MIN_SUBPROBLEMS <= len(subproblems) <= max_subproblems:
        raise MalformedPlan(
            f"should_decompose is true: expected {MIN_SUBPROBLEMS} to {max_subproblems} subproblems, "
            f"got {len(subproblems)}"
        )
    if not value["should_decompose"] and subproblems:
        raise MalformedPlan(f"should_decompose is false but {len(subproblems)} subproblems are listed")
    return Plan(
        should_decompose=value["should_decompose"],
        subproblems=tuple(s.strip() for s in subproblems),
        plan=value["plan"].strip(),
    )


__all__ = ["MIN_SUBPROBLEMS", "MalformedPlan", "Plan", "parse_plan", "strip_thinking"]
