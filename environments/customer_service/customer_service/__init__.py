"""customer-service: a support dialogue with a simulated customer, over tools on an in-memory order store.

Each task is a seeded scenario (:mod:`customer_service.scenarios`): a customer with a goal (learn an order's
status, get a refund, or change an order's shipping address), the shop's orders, and facts the customer holds back
until asked (the order id, the new address, its name and email). The customer opens with a vague message. The agent
has three tools over a store that is fresh for each rollout (:mod:`customer_service.tools`): ``lookup_order``,
``issue_refund`` and ``update_address``. Whenever the agent answers without a tool call, the customer replies: a
scripted one by default (:mod:`customer_service.customer`), or a model on an OpenAI-compatible server
(``customer = "model"``: :mod:`customer_service.model_customer`). The rollout ends when the goal is met (the
customer leaves) or after ``max_turns`` agent turns.

Rewards (weights in the config; formulas in :mod:`customer_service.rewards`): ``goal_resolved`` (1 if the goal is
met), ``no_wrong_action`` (1 if the agent made no write the goal did not ask for), ``politeness`` (share of replies
with a courtesy marker and no rude one) and ``brevity`` (mean of ``min(1, max_reply_words / words)`` per reply).
"""

from typing import Annotated, Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator
from reward_weights import with_reward_weights

from customer_service import rewards
from customer_service.scenarios import GOAL_KINDS, GoalKind, Scenario, generate_scenarios
from customer_service.store import Store, replay
from customer_service.transcript import agent_replies, tool_calls
from orchestrator.verifiers_adapter.harness import InProcessHarness

TOOLS = [f"customer_service.tools:{name}" for name in ("lookup_order", "issue_refund", "update_address")]
CUSTOMERS = {
    "scripted": "customer_service.customer:scripted_reply",
    "model": "customer_service.model_customer:model_reply",
}
SYSTEM_PROMPT = (
    "You are a customer-service agent for an online shop. Help the customer using your tools: lookup_order shows an "
    "order, issue_refund refunds a delivered order, update_address changes where an order that has not shipped yet "
    "will go. Ask the customer for their order number and any detail you need. Take only the actions the customer "
    "asks for, on the order they mean, then tell them what you found or did. Be polite and brief."
)


class CustomerServiceConfig(vf.TasksetConfig):
    num_examples: Annotated[int, Field(ge=1)] = 512
    """Scenarios generated."""
    seed: int = 0
    """Seed of the scenario generator."""
    goals: Annotated[list[GoalKind], Field(min_length=1)] = list(GOAL_KINDS)
    """Goal kinds to draw from: order_status, refund, address_change."""
    orders_per_customer: Annotated[int, Field(ge=1, le=5)] = 3
    """Orders of the scenario's customer (the goal is about one of them)."""
    max_turns: Annotated[int, Field(ge=1)] = 8
    """Agent turns per rollout (tool calls and replies)."""
    customer: Literal["scripted", "model"] = "scripted"
    """Who plays the customer: keyword rules, or customer_model on the server at customer_base_url."""
    customer_base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible API root of the model customer's server (customer = "model")."""
    customer_model: str | None = None
    """Model name the server serves for the customer (customer = "model"; required there)."""
    customer_max_tokens: Annotated[int, Field(ge=1)] = 64
    """Tokens per message of the model customer."""
    max_reply_words: Annotated[int, Field(ge=1)] = 50
    """Words per reply above which brevity falls below 1."""
    goal_resolved_weight: float = 1.0
    """Weight of goal_resolved."""
    no_wrong_action_weight: float = 0.5
    """Weight of no_wrong_action."""
    politeness_weight: float = 0.1
    """Weight of politeness."""
    brevity_weight: float = 0.1
    """Weight of brevity."""

    @model_validator(mode="after")
    def _model_customer_named(self):
        if self.customer == "model" and not self.customer_model:
            raise ValueError('customer = "model" needs customer_model: a model name the server serves')
        return self


class CustomerServiceData(vf.TaskData):
    scenario: Scenario
    """The customer, its goal and hidden facts, and the shop's orders."""
    tools: list[str] = TOOLS
    """The agent's tools, as module:function paths."""
    final_tools: list[str] = []
    """Tools whose call ends the rollout (none: the customer ends it)."""
    max_turns: int = 8
    """Agent turns per rollout."""
    user: str = CUSTOMERS["scripted"]
    """The simulated customer, as a module:function path."""
    max_reply_words: int = 50
    customer_base_url: str | None = None
    customer_model: str | None = None
    customer_max_tokens: int = 64


def outcome(task: CustomerServiceData, trace: vf.Trace) -> tuple[Store, list[str]]:
    """The store the rollout left (its tool calls replayed) and the agent's replies to the customer."""
    messages = trace.assistant_messages
    return replay(task.scenario.orders, tool_calls(messages)), agent_replies(messages)


class CustomerServiceTask(vf.Task[CustomerServiceData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def goal_resolved(self, task: CustomerServiceData, trace: vf.Trace) -> float:
        return float(rewards.goal_resolved(task.scenario.goal, *outcome(task, trace)))

    @vf.reward(weight=0.5)
    async def no_wrong_action(self, task: CustomerServiceData, trace: vf.Trace) -> float:
        store, _ = outcome(task, trace)
        return float(not rewards.wrong_actions(task.scenario.goal, store.actions))

    @vf.reward(weight=0.1)
    async def politeness(self, task: CustomerServiceData, trace: vf.Trace) -> float:
        return rewards.politeness(agent_replies(trace.assistant_messages))

    @vf.reward(weight=0.1)
    async def brevity(self, task: CustomerServiceData, trace: vf.Trace) -> float:
        return rewards.brevity(agent_replies(trace.assistant_messages), task.max_reply_words)


class CustomerServiceTaskset(vf.Taskset[CustomerServiceTask, CustomerServiceConfig]):
    def load(self):
        config = self.config
        task_config = self.task_config()
        scenarios = generate_scenarios(
            config.num_examples, config.seed, tuple(config.goals), config.orders_per_customer
        )
        for i, scenario in enumerate(scenarios):
            data = CustomerServiceData(
                id=f"customer-service-{config.seed}-{i}",
                name=f"{scenario.goal.kind} {scenario.goal.order_id}",
                prompt=scenario.opening,
                system_prompt=SYSTEM_PROMPT,
                scenario=scenario,
                max_turns=config.max_turns,
                user=CUSTOMERS[config.customer],
                max_reply_words=config.max_reply_words,
                customer_base_url=config.customer_base_url,
                customer_model=config.customer_model,
                customer_max_tokens=config.customer_max_tokens,
            )
            yield CustomerServiceTask(data, task_config)

    def task_config(self) -> vf.TaskConfig:
        """The config's task settings, with this config's reward weights (a weight set under ``task.rewards``
        wins)."""
        config = self.config
        weights = {
            "goal_resolved": config.goal_resolved_weight,
            "no_wrong_action": config.no_wrong_action_weight,
            "politeness": config.politeness_weight,
            "brevity": config.brevity_weight,
        }
        return with_reward_weights(config.task, weights)


__all__ = [
    "InProcessHarness",
    "CustomerServiceConfig",
    "CustomerServiceData",
    "CustomerServiceTask",
    "CustomerServiceTaskset",
]
