"""A customer played by a model on an OpenAI-compatible server (``customer = "model"`` in the config).

The model gets a persona (the goal and the hidden facts, to give only when asked) and the conversation from the
customer's side: the agent's replies as user turns, the customer's messages as its own, tool traffic left out. It
is called through ``POST {customer_base_url}/chat/completions`` (with ``$TRIDENT_API_KEY`` when set), outside
verifiers' training client, so its tokens are never trained. When the customer leaves is still decided by rule
(:func:`customer_service.customer.goal_met`), and an empty answer falls back to the scripted customer's.
"""

import os
from typing import Any

import httpx

from customer_service.customer import goal_met, respond
from customer_service.scenarios import Scenario
from customer_service.transcript import agent_replies, text

GOALS = {
    "order_status": "You want to know the status of your order of a {item}.",
    "refund": "The {item} you received is broken and you want a refund for it.",
    "address_change": "You moved, and your order of a {item} must go to your new address instead.",
}
PERSONA = (
    "You are {name}, a customer writing to an online shop's support agent. {goal} You know these facts: your order "
    "number is {order_id}; your email is {email}{address}. Give a fact only when the agent asks for it. Write one or "
    "two short sentences as the customer; never write as the agent."
)
TIMEOUT_S = 120.0
API_KEY_ENV = "TRIDENT_API_KEY"
"""The inference server's key, sent when set (the server checks it when it was started with one)."""


def customer_messages(messages: list[Any], scenario: Scenario) -> list[dict[str, str]]:
    """The chat the customer model continues: its persona, then the conversation with the roles swapped."""
    goal = scenario.goal
    persona = PERSONA.format(
        name=scenario.customer.name,
        goal=GOALS[goal.kind].format(item=goal.item),
        order_id=goal.order_id,
        email=scenario.customer.email,
        address=f"; your new address is {goal.new_address}" if goal.new_address else "",
    )
    chat = [{"role": "system", "content": persona}]
    for message in messages:
        if message.get("role") == "user":
            chat.append({"role": "assistant", "content": text(message)})
        elif message.get("role") == "assistant" and not message.get("tool_calls"):
            chat.append({"role": "user", "content": text(message)})
    return chat


async def model_reply(messages: list[Any], task: Any, client: httpx.AsyncClient | None = None) -> str | None:
    """The customer's next message, written by ``task.customer_model``; None once the goal is met."""
    if goal_met(messages, task.scenario):
        return None
    if client is None:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            return await model_reply(messages, task, client)
    url = f"{task.customer_base_url.rstrip('/')}/chat/completions"
    response = await client.post(
        url,
        headers={"Authorization": f"Bearer {key}"} if (key := os.environ.get(API_KEY_ENV)) else {},
        json={
            "model": task.customer_model,
            "messages": customer_messages(messages, task.scenario),
            "max_tokens": task.customer_max_tokens,
        },
    )
    if response.status_code != 200:
        raise RuntimeError(f"customer model at {url} answered {response.status_code}: {response.text[:200]}")
    reply = text(response.json()["choices"][0]["message"]).strip()
    replies = agent_replies(messages)
    return reply or respond(task.scenario, replies[-1] if replies else "")


__all__ = ["customer_messages", "model_reply"]
