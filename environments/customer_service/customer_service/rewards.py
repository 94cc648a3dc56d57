"""Reward math, as pure functions of the goal, the store a rollout left (:func:`customer_service.store.replay`)
and the agent's replies to the customer (assistant messages without tool calls).

- goal resolved: a refund goal's order is refunded; an address change goal's order ships to the new address
  (compared after :func:`~customer_service.store.normalize_address`); an order status goal's status was told: some
  reply names the order's current status word (processing, shipped, delivered, refunded) and no other.
- wrong actions: writes the goal did not ask for: a refund or an address change of another order, one of a kind
  the goal is not (any write for an order status goal), or an address change to another address.
- politeness: the share of replies that hold a courtesy marker (:data:`POLITE`) and no rude one (:data:`RUDE`).
- brevity: the mean over replies of ``min(1, max_words / words)``; a reply without words scores 0.

Politeness and brevity are 0 when the agent never replied, so silence is not rewarded.
"""

import re
from collections.abc import Sequence

from customer_service.scenarios import Goal
from customer_service.store import Action, Store, normalize_address

STATUS_WORD = re.compile(r"\b(processing|shipped|delivered|refunded)\b", re.IGNORECASE)
POLITE = re.compile(
    r"\b(please|thanks|thank you|sorry|apologi[sz]e|apologies|happy to help|glad to help|my pleasure|"
    r"you're welcome|you are welcome)\b",
    re.IGNORECASE,
)
RUDE = re.compile(r"\b(stupid|idiot|dumb|shut up|whatever|not my problem|calm down|hurry up)\b", re.IGNORECASE)


def stated_statuses(reply: str) -> set[str]:
    """The status words a reply names, lower-cased."""
    return {word.lower() for word in STATUS_WORD.findall(reply)}


def same_address(a: str | None, b: str | None) -> bool:
    """Whether two addresses are equal up to case, punctuation and spacing."""
    return normalize_address(a or "") == normalize_address(b or "")


def goal_resolved(goal: Goal, store: Store, replies: Sequence[str]) -> bool:
    """Whether the customer's goal is met (see the module docstring)."""
    order = store.orders[goal.order_id]
    if goal.kind == "refund":
        return order.status == "refunded"
    if goal.kind == "address_change":
        return same_address(order.address, goal.new_address)
    return any(stated_statuses(reply) == {order.status} for reply in replies)


def is_wanted(goal: Goal, action: Action) -> bool:
    """Whether ``action`` is the write the goal asks for."""
    if action.order_id != goal.order_id:
        return False
    if goal.kind == "refund":
        return action.tool == "issue_refund"
    if goal.kind == "address_change":
        return action.tool == "update_address" and same_address(action.address, goal.new_address)
    return False


def wrong_actions(goal: Goal, actions: Sequence[Action]) -> list[Action]:
    """The writes the goal did not ask for, in order."""
    return [action for action in actions if not is_wanted(goal, action)]


def politeness(replies: Sequence[str]) -> float:
    """Share of replies with a courtesy marker and no rude marker; 0.0 without replies."""
    if not replies:
        return 0.0
    return sum(bool(POLITE.search(r)) and not RUDE.search(r) for r in replies) / len(replies)


def reply_brevity(reply: str, max_words: int) -> float:
    """1.0 up to ``max_words`` words, ``max_words / words`` beyond; 0.0 for a reply without words."""
    words = len(reply.split())
    return min(1.0, max_words / words) if words else 0.0


def brevity(replies: Sequence[str], max_words: int) -> float:
    """Mean :func:`reply_brevity` of the replies; 0.0 without replies."""
    return sum(reply_brevity(r, max_words) for r in replies) / len(replies) if replies else 0.0


__all__ = ["brevity", "goal_resolved", "politeness", "reply_brevity", "stated_statuses", "wrong_actions"]
