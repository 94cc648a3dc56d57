"""Reading a conversation: the agent's tool calls and its replies to the customer.

Messages come in two shapes: the harness's OpenAI-style dicts (what the customer function receives) and
verifiers' message objects (what a trace holds). Both are read the same way.
"""

from collections.abc import Iterable
from typing import Any


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def text(message: Any) -> str:
    """A message's text content; ``""`` when it has none (or only non-text parts)."""
    content = _field(message, "content")
    return content if isinstance(content, str) else ""


def tool_calls(messages: Iterable[Any]) -> list[tuple[str, str]]:
    """Every tool call of the agent's messages, in order, as (name, JSON arguments)."""
    calls = []
    for message in messages:
        if _field(message, "role") != "assistant":
            continue
        for call in _field(message, "tool_calls") or []:
            function = _field(call, "function") or call  # OpenAI nests name and arguments; verifiers does not
            calls.append((str(_field(function, "name") or ""), str(_field(function, "arguments") or "")))
    return calls


def agent_replies(messages: Iterable[Any]) -> list[str]:
    """The text of each agent message to the customer (an assistant message without tool calls), in order."""
    return [
        text(message)
        for message in messages
        if _field(message, "role") == "assistant" and not _field(message, "tool_calls")
    ]


__all__ = ["agent_replies", "text", "tool_calls"]
