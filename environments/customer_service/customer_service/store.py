"""The shop's order store: what the tools read and change, one store per rollout.

Each tool is a method that either answers (a line for the model) or raises :class:`StoreError` and changes
nothing. Shop policy: only a delivered order can be refunded, and only once; only an order still processing can be
sent to another address. Order ids are matched case-insensitively, with or without a leading ``#``.

:func:`replay` runs a rollout's recorded tool calls against a fresh store: since the tools are deterministic, it
rebuilds exactly the store the rollout left, which is how the customer and the rewards see what the agent did.
"""

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from customer_service.scenarios import Order

TOOL_NAMES = ("lookup_order", "issue_refund", "update_address")
INJECTED = ("runtime", "task")
"""Tool parameters the harness fills in; a call's own values for them are ignored."""
MAX_ADDRESS_CHARS = 200


class StoreError(ValueError):
    """A tool call the store refuses; the message is meant for the model."""


@dataclass(frozen=True)
class Action:
    """A write the store carried out."""

    tool: str
    order_id: str
    address: str | None = None


def normalize_order_id(order_id: Any) -> str:
    """``"#w1234 "`` -> ``"W1234"``."""
    return str(order_id).strip().lstrip("#").strip().upper()


def normalize_address(address: str) -> str:
    """Lower case, punctuation as spaces, single spaces: ``"12 Oak St.,  Lakeside"`` -> ``"12 oak st lakeside"``."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", address.lower()).split())


def dollars(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


class Store:
    def __init__(self, orders: Iterable[Order]) -> None:
        self.orders: dict[str, Order] = {order.order_id: order for order in orders}
        self.actions: list[Action] = []
        """The writes carried out, in order."""

    def _order(self, order_id: Any) -> Order:
        order = self.orders.get(normalize_order_id(order_id))
        if order is None:
            raise StoreError(f"no order {order_id!r}; order ids look like W1234")
        return order

    def lookup_order(self, order_id: str) -> str:
        order = self._order(order_id)
        return (
            f"Order {order.order_id}: status {order.status}; item: {order.item}; total {dollars(order.total_cents)}; "
            f"customer {order.customer}; shipping address {order.address}."
        )

    def issue_refund(self, order_id: str) -> str:
        order = self._order(order_id)
        if order.status == "refunded":
            raise StoreError(f"order {order.order_id} is already refunded")
        if order.status != "delivered":
            raise StoreError(f"order {order.order_id} is {order.status}: only delivered orders can be refunded")
        self.orders[order.order_id] = order.model_copy(update={"status": "refunded"})
        self.actions.append(Action("issue_refund", order.order_id))
        return f"Refunded {dollars(order.total_cents)} for order {order.order_id}; its status is now refunded."

    def update_address(self, order_id: str, address: str) -> str:
        order = self._order(order_id)
        if not isinstance(address, str) or not address.strip():
            raise StoreError("address must be a non-empty string")
        if len(address) > MAX_ADDRESS_CHARS:
            raise StoreError(f"address too long: {len(address)} characters, at most {MAX_ADDRESS_CHARS}")
        if order.status != "processing":
            raise StoreError(f"order {order.order_id} is {order.status}: only processing orders can change address")
        address = " ".join(address.split())
        self.orders[order.order_id] = order.model_copy(update={"address": address})
        self.actions.append(Action("update_address", order.order_id, address))
        return f"Order {order.order_id} will now ship to {address}."


def replay(orders: Iterable[Order], calls: Iterable[tuple[str, str]]) -> Store:
    """A fresh store of ``orders`` after running ``calls`` ((name, JSON arguments), in order) as the harness runs
    them: arguments must be a JSON object; a call that fails (unknown tool, malformed arguments, a refusal) changes
    nothing."""
    store = Store(orders)
    for name, arguments in calls:
        if name not in TOOL_NAMES:
            continue
        try:
            kwargs = json.loads(arguments or "{}")
            getattr(store, name)(**{k: v for k, v in kwargs.items() if k not in INJECTED})
        except Exception:  # the harness answers the model with the error; the store is unchanged either way
            continue
    return store


__all__ = ["TOOL_NAMES", "Action", "Store", "StoreError", "normalize_address", "normalize_order_id", "replay"]
