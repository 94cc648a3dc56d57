"""The scripted customer: the harness calls :func:`scripted_reply` whenever the agent answers without a tool call.

The customer leaves (``None``, which ends the rollout) as soon as the goal is met, judged as the reward judges it:
the agent's tool calls replayed on a fresh store, and its replies. Otherwise it answers the agent's last reply with
simple keyword rules (:data:`RULES`): asked for the order number, it gives the goal's order id; for the address,
the new address (address changes); for its name or email, those; asked to confirm, it agrees. A reply that asks for
nothing it knows gets a nudge that restates the goal.
"""

import re
from collections.abc import Callable
from typing import Any

from customer_service.rewards import goal_resolved
from customer_service.scenarios import Scenario
from customer_service.store import replay
from customer_service.transcript import agent_replies, tool_calls

RULES: list[tuple[re.Pattern, Callable[[Scenario], str]]] = [
    (
        re.compile(r"\border\s*(number|no\b|id\b|#)|\b(which|what) order\b", re.IGNORECASE),
        lambda s: f"It's order {s.goal.order_id}.",
    ),
    (
        re.compile(r"\baddress\b", re.IGNORECASE),
        lambda s: (
            f"The new address is {s.goal.new_address}." if s.goal.new_address else "I don't need to change my address."
        ),
    ),
    (re.compile(r"\bname\b", re.IGNORECASE), lambda s: f"My name is {s.customer.name}."),
    (re.compile(r"\be-?mail\b", re.IGNORECASE), lambda s: f"My email is {s.customer.email}."),
    (
        re.compile(r"\b(confirm|shall i|should i|would you like|do you want|go ahead)\b", re.IGNORECASE),
        lambda s: "Yes, please go ahead.",
    ),
]
NUDGES = {
    "order_status": "I'd just like to know what's happening with my {item}.",
    "refund": "Can you refund my {item}, please?",
    "address_change": "I need my {item} sent to my new address, please.",
}


def goal_met(messages: list[Any], scenario: Scenario) -> bool:
    """Whether the conversation so far meets the customer's goal."""
    store = replay(scenario.orders, tool_calls(messages))
    return goal_resolved(scenario.goal, store, agent_replies(messages))


def respond(scenario: Scenario, agent_reply: str) -> str:
    """The customer's answer to ``agent_reply``: the facts it asks for, else a nudge."""
    answers = [answer(scenario) for pattern, answer in RULES if pattern.search(agent_reply)]
    return " ".join(answers) or NUDGES[scenario.goal.kind].format(item=scenario.goal.item)


def scripted_reply(messages: list[Any], task: Any) -> str | None:
    """The customer's next message, or None once the goal is met (the customer leaves)."""
    if goal_met(messages, task.scenario):
        return None
    replies = agent_replies(messages)
    return respond(task.scenario, replies[-1] if replies else "")


__all__ = ["goal_met", "respond", "scripted_reply"]
