"""Seeded scenarios: a customer with a goal, the shop's orders, and the facts the customer holds back.

A scenario's shop holds the customer's orders (one of them the goal's order, each for a different item) and a
few orders of other customers. The goal's order fits the goal: a refund is asked for a delivered order, an address
change for one still processing. The customer's opening message names the goal and the item, never the order id.
"""

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict

GoalKind = Literal["order_status", "refund", "address_change"]
GOAL_KINDS: tuple[GoalKind, ...] = ("order_status", "refund", "address_change")
Status = Literal["processing", "shipped", "delivered", "refunded"]
OPEN_STATUSES: tuple[Status, ...] = ("processing", "shipped", "delivered")
OTHER_ORDERS = 4
"""Orders of other customers in each scenario's shop."""

FIRST_NAMES = "Ana Ben Chen Dara Eli Fatima Goran Hiro Ines Jonas Kemi Luca Maya Nikhil Olga Pablo Rina Sven".split()
LAST_NAMES = "Alvarez Brooks Costa Dubois Eriksen Fischer Garcia Haddad Ito Jensen Kowalski Lopez Moreau Novak".split()
STREETS = "Oak Street|Maple Avenue|Elm Road|Harbor Lane|Birch Way|Station Road|Mill Street|Cedar Court".split("|")
CITIES = "Springfield|Riverton|Lakeside|Fairview|Greenville|Bridgeport|Ashford|Kingsley".split("|")
ITEMS = (
    "desk lamp|kettle|pair of running shoes|backpack|coffee grinder|wool scarf|phone case|yoga mat|toaster|"
    "bluetooth speaker|cast iron pan|board game|rain jacket|water bottle|alarm clock|set of towels"
).split("|")
OPENINGS: dict[GoalKind, tuple[str, ...]] = {
    "order_status": (
        "Hi, I ordered a {item} a while ago and I'm wondering where it is.",
        "Hello, can you tell me what's going on with my {item}?",
    ),
    "refund": (
        "Hello, the {item} I got is broken and I'd like my money back.",
        "Hi, I'm not happy with the {item} I received. I want a refund.",
    ),
    "address_change": (
        "Hi, I just moved and I need my {item} to go to my new place.",
        "Hello, I ordered a {item} but I need it delivered somewhere else.",
    ),
}
STATUS_FOR_GOAL: dict[GoalKind, tuple[Status, ...]] = {
    "order_status": OPEN_STATUSES,
    "refund": ("delivered",),
    "address_change": ("processing",),
}


class Order(BaseModel):
    model_config = ConfigDict(frozen=True)

    order_id: str
    """Like ``W1234``."""
    customer: str
    """The name of the customer who placed it."""
    item: str
    total_cents: int
    status: Status
    address: str
    """Where it ships."""


class Customer(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    email: str


class Goal(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: GoalKind
    order_id: str
    """The order the goal is about (a hidden fact: the customer gives it when asked)."""
    item: str
    """What that order holds (named in the opening message)."""
    new_address: str | None = None
    """Where the order must go instead (address changes; a hidden fact)."""


class Scenario(BaseModel):
    model_config = ConfigDict(frozen=True)

    customer: Customer
    goal: Goal
    orders: tuple[Order, ...]
    """The shop's orders: the customer's and other customers'."""
    opening: str
    """The customer's first message."""


def random_address(rng: random.Random) -> str:
    return f"{rng.randint(1, 999)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"


def generate_scenario(rng: random.Random, goals: tuple[GoalKind, ...], orders_per_customer: int) -> Scenario:
    """One scenario drawn from ``rng``: a goal of one of the ``goals`` kinds, ``orders_per_customer`` orders of the
    customer (the goal's first) and :data:`OTHER_ORDERS` of other customers, shuffled."""
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    customer = Customer(name=f"{first} {last}", email=f"{first}.{last}@example.com".lower())
    home = random_address(rng)
    kind = rng.choice(goals)
    ids = [f"W{n}" for n in rng.sample(range(1000, 10000), orders_per_customer + OTHER_ORDERS)]
    items = rng.sample(ITEMS, orders_per_customer + OTHER_ORDERS)
    statuses = [rng.choice(STATUS_FOR_GOAL[kind])] + [rng.choice(OPEN_STATUSES) for _ in ids[1:]]
    owners = [customer.name] * orders_per_customer
    while len(owners) < orders_per_customer + OTHER_ORDERS:
        if (other := f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}") != customer.name:
            owners.append(other)
    orders = [
        Order(
            order_id=order_id,
            customer=owner,
            item=item,
            total_cents=rng.randint(8, 250) * 100 + rng.choice((0, 49, 95, 99)),
            status=status,
            address=home if owner == customer.name else random_address(rng),
        )
        for order_id, owner, item, status in zip(ids, owners, items, statuses, strict=True)
    ]
    new_address = None
    if kind == "address_change":
        while (new_address := random_address(rng)) == home:
            pass
    goal = Goal(kind=kind, order_id=ids[0], item=items[0], new_address=new_address)
    opening = rng.choice(OPENINGS[kind]).format(item=goal.item)
    rng.shuffle(orders)
    return Scenario(customer=customer, goal=goal, orders=tuple(orders), opening=opening)


def generate_scenarios(
    num_examples: int, seed: int, goals: tuple[GoalKind, ...] = GOAL_KINDS, orders_per_customer: int = 3
) -> list[Scenario]:
    """``num_examples`` scenarios; the same arguments give the same scenarios."""
    rng = random.Random(seed)
    return [generate_scenario(rng, goals, orders_per_customer) for _ in range(num_examples)]


__all__ = ["GOAL_KINDS", "Customer", "Goal", "GoalKind", "Order", "Scenario", "Status", "generate_scenarios"]
