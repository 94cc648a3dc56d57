"""The agent's tools over the rollout's in-memory store.

Trident's harness imports them by ``module:function`` path, shows the model each one's name, docstring and the
parameters other than ``runtime`` and ``task``, and fills those two in: the rollout's verifiers runtime (a new
object per rollout, the key of the rollout's store) and the task's data (whose scenario seeds the store). A
refusal raises :class:`~customer_service.store.StoreError`, which the harness hands the model as its answer.
"""

import weakref
from typing import Any

from customer_service.store import Store

_stores: "weakref.WeakKeyDictionary[Any, Store]" = weakref.WeakKeyDictionary()


def rollout_store(runtime: Any, task: Any) -> Store:
    """The rollout's store: made from the task's scenario on the rollout's first tool call, dropped with its runtime."""
    store = _stores.get(runtime)
    if store is None:
        store = _stores[runtime] = Store(task.scenario.orders)
    return store


def lookup_order(order_id: str, runtime: Any, task: Any) -> str:
    """Look up an order by its id (e.g. "W1234"): its status, item, total, customer and shipping address."""
    return rollout_store(runtime, task).lookup_order(order_id)


def issue_refund(order_id: str, runtime: Any, task: Any) -> str:
    """Refund a delivered order in full (e.g. "W1234"). Only do this when the customer asks for a refund of that
    order."""
    return rollout_store(runtime, task).issue_refund(order_id)


def update_address(order_id: str, address: str, runtime: Any, task: Any) -> str:
    """Change the shipping address of an order that has not shipped yet (status processing). Only do this when the
    customer asks, with the exact new address they give."""
    return rollout_store(runtime, task).update_address(order_id, address)


__all__ = ["issue_refund", "lookup_order", "rollout_store", "update_address"]
