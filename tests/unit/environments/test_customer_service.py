import asyncio
import gc
import inspect
import json
from pathlib import Path

import customer_service
import httpx
import pytest
import verifiers.v1 as vf
from aiohttp import web
from aiohttp.test_utils import TestServer
from customer_service import customer, model_customer, rewards, scenarios, tools
from customer_service.store import TOOL_NAMES, Store, StoreError, normalize_address, replay
from customer_service.transcript import agent_replies, tool_calls
from scored_traces import scored_trace

from contracts.config import parse_config
from launch.rl_config import RLConfig, resolve_shared
from orchestrator.verifiers_adapter import harness


def taskset(**config) -> list[customer_service.CustomerServiceTask]:
    return list(customer_service.CustomerServiceTaskset(customer_service.CustomerServiceConfig(**config)))


def first_task(kind: str, **config) -> customer_service.CustomerServiceTask:
    return taskset(num_examples=1, goals=[kind], **config)[0]


def other_order(scenario: scenarios.Scenario, status: str = "delivered") -> scenarios.Order:
    """An order of the shop other than the goal's, with ``status``."""
    return next(o for o in scenario.orders if o.order_id != scenario.goal.order_id and o.status == status)


def scenario_with_other_delivered_order(kind: str) -> scenarios.Scenario:
    return next(
        s
        for s in scenarios.generate_scenarios(50, seed=1, goals=(kind,))
        if any(o.status == "delivered" and o.order_id != s.goal.order_id for o in s.orders)
    )


class Runtime:
    """Stands in for a rollout's verifiers runtime: a distinct object per rollout."""


# --- scenarios


def test_generator_is_deterministic_per_seed():
    assert scenarios.generate_scenarios(40, seed=3) == scenarios.generate_scenarios(40, seed=3)
    assert scenarios.generate_scenarios(40, seed=3) != scenarios.generate_scenarios(40, seed=4)
    assert [t.data for t in taskset(num_examples=5, seed=2)] == [t.data for t in taskset(num_examples=5, seed=2)]


def test_generated_goals_fit_the_orders_and_the_opening_hides_the_facts():
    generated = scenarios.generate_scenarios(300, seed=0, orders_per_customer=3)
    assert {s.goal.kind for s in generated} == set(scenarios.GOAL_KINDS)
    for s in generated:
        orders = {o.order_id: o for o in s.orders}
        assert len(orders) == 3 + scenarios.OTHER_ORDERS
        target = orders[s.goal.order_id]
        assert target.customer == s.customer.name and target.item == s.goal.item
        assert [o.item for o in s.orders if o.customer == s.customer.name].count(s.goal.item) == 1
        assert sum(o.customer == s.customer.name for o in s.orders) == 3
        assert target.status == {"refund": "delivered", "address_change": "processing"}.get(s.goal.kind, target.status)
        assert (s.goal.new_address is not None) == (s.goal.kind == "address_change")
        assert s.goal.new_address != target.address
        assert s.goal.item in s.opening and s.goal.order_id not in s.opening
        assert s.customer.name not in s.opening and (s.goal.new_address or "@") not in s.opening


def test_goal_kinds_can_be_restricted():
    assert {s.goal.kind for s in scenarios.generate_scenarios(30, seed=0, goals=("refund",))} == {"refund"}


def test_taskset_builds_tasks_with_the_harness_fields():
    tasks = taskset(num_examples=6, max_turns=5)
    assert len({t.data.id for t in tasks}) == 6
    data = tasks[0].data
    assert [path.rpartition(":")[2] for path in data.tools] == ["lookup_order", "issue_refund", "update_address"]
    assert all(callable(harness._import(path)) for path in data.tools)
    assert data.final_tools == [] and data.max_turns == 5
    assert harness._import(data.user) is customer.scripted_reply
    assert data.prompt == data.scenario.opening and "order number" in data.system_prompt


def test_exactly_one_taskset_is_exported():
    exported = [getattr(customer_service, name) for name in customer_service.__all__]
    assert [c for c in exported if isinstance(c, type) and issubclass(c, vf.Taskset)] == [
        customer_service.CustomerServiceTaskset
    ]


def test_model_customer_needs_a_model_name():
    with pytest.raises(ValueError, match="needs customer_model"):
        customer_service.CustomerServiceConfig(customer="model")
    data = first_task("refund", customer="model", customer_model="m", customer_base_url="http://h:1/v1").data
    assert harness._import(data.user) is model_customer.model_reply
    assert (data.customer_model, data.customer_base_url) == ("m", "http://h:1/v1")


# --- the store and the tools


def test_store_policies():
    s = next(
        s
        for s in scenarios.generate_scenarios(50, seed=0, goals=("refund",))
        if {"processing", "shipped"} <= {o.status for o in s.orders}
    )
    store = Store(s.orders)
    processing, shipped = other_order(s, "processing"), other_order(s, "shipped")
    assert "status delivered" in store.lookup_order(f" #{s.goal.order_id.lower()}")
    with pytest.raises(StoreError, match="no order 'W0'"):
        store.lookup_order("W0")
    assert "Refunded $" in store.issue_refund(s.goal.order_id)
    with pytest.raises(StoreError, match="already refunded"):
        store.issue_refund(s.goal.order_id)
    with pytest.raises(StoreError, match="only delivered orders can be refunded"):
        store.issue_refund(processing.order_id)
    with pytest.raises(StoreError, match="non-empty string"):
        store.update_address(processing.order_id, 42)
    with pytest.raises(StoreError, match="only processing orders can change address"):
        store.update_address(shipped.order_id, "7 Mill Street, Ashford")
    reply = store.update_address(processing.order_id, "  7  Mill Street,  Ashford ")
    assert reply == f"Order {processing.order_id} will now ship to 7 Mill Street, Ashford."
    assert [(a.tool, a.order_id) for a in store.actions] == [
        ("issue_refund", s.goal.order_id),
        ("update_address", processing.order_id),
    ]


def test_tools_change_only_their_rollouts_store():
    task = first_task("refund").data
    order_id = task.scenario.goal.order_id
    first, second = Runtime(), Runtime()
    assert "Refunded" in tools.issue_refund(order_id, first, task)
    assert "status refunded" in tools.lookup_order(order_id, first, task)
    assert "status delivered" in tools.lookup_order(order_id, second, task)  # another rollout: untouched
    assert next(o for o in task.scenario.orders if o.order_id == order_id).status == "delivered"
    assert tools.rollout_store(first, task) is tools.rollout_store(first, task)
    count = len(tools._stores)
    del first
    gc.collect()
    assert len(tools._stores) == count - 1  # a rollout's store goes with its runtime


def test_tools_through_the_harness_report_errors_and_change_nothing():
    task = first_task("address_change").data
    injected = {"runtime": Runtime(), "task": task}
    order_id = task.scenario.goal.order_id

    def call(fn, arguments: str) -> str:
        return asyncio.run(harness.call_tool(fn, arguments, injected))

    assert call(tools.update_address, "not json").startswith("error: JSONDecodeError")
    assert call(tools.update_address, '["W1"]').startswith("error: TypeError")
    assert call(tools.update_address, json.dumps({"order_id": order_id})).startswith("error: TypeError")
    assert call(tools.update_address, json.dumps({"order_id": "W0", "address": "x"})).startswith(
        "error: StoreError: no order 'W0'"
    )
    assert call(tools.issue_refund, json.dumps({"order_id": order_id})).startswith("error: StoreError")
    assert tools.rollout_store(injected["runtime"], task).actions == []
    arguments = json.dumps({"order_id": order_id, "address": task.scenario.goal.new_address})
    assert (
        call(tools.update_address, arguments) == f"Order {order_id} will now ship to {task.scenario.goal.new_address}."
    )


def test_replay_rebuilds_the_store_the_tools_left():
    s = scenario_with_other_delivered_order("refund")
    calls = [
        ("issue_refund", json.dumps({"order_id": other_order(s).order_id})),
        ("issue_refund", "{not json"),
        ("issue_refund", "[]"),
        ("update_address", json.dumps({"order_id": s.goal.order_id})),
        ("delete_everything", "{}"),
        ("issue_refund", json.dumps({"order_id": s.goal.order_id, "runtime": "ignored"})),
        ("issue_refund", json.dumps({"order_id": s.goal.order_id})),  # refused: already refunded
    ]
    data = customer_service.CustomerServiceData(scenario=s)
    live = Runtime()
    for name, arguments in calls:
        fn = getattr(tools, name, None)
        if fn is not None:
            asyncio.run(harness.call_tool(fn, arguments, {"runtime": live, "task": data}))
    replayed = replay(s.orders, calls)
    assert replayed.orders == tools.rollout_store(live, data).orders
    assert replayed.actions == tools.rollout_store(live, data).actions
    assert [a.order_id for a in replayed.actions] == [other_order(s).order_id, s.goal.order_id]


def test_tool_parameters_are_the_store_methods():
    for name in TOOL_NAMES:
        spec = harness.tool_spec(getattr(tools, name))["function"]
        assert spec["name"] == name and spec["description"]
        assert list(spec["parameters"]["properties"]) == list(inspect.signature(getattr(Store, name)).parameters)[1:]


# --- rewards


def call(name: str, arguments, index: int = 0) -> vf.AssistantMessage:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return vf.AssistantMessage(tool_calls=[vf.ToolCall(id=f"c{index}", name=name, arguments=raw)])


def say(content: str | None) -> vf.AssistantMessage:
    return vf.AssistantMessage(content=content)


def score(task, assistant_messages: list[vf.AssistantMessage]) -> dict[str, tuple[float, float]]:
    trace = scored_trace(task, assistant_messages)
    return {name: (reward.score, reward.weight) for name, reward in trace.rewards.items()}


def scores(task, assistant_messages) -> dict[str, float]:
    return {name: value for name, (value, _) in score(task, assistant_messages).items()}


def test_correct_refund_scores_every_term_with_the_default_weights():
    task = first_task("refund")
    order_id = task.data.scenario.goal.order_id
    messages = [
        say("Sorry to hear that! Could you give me your order number, please?"),
        call("lookup_order", {"order_id": order_id}),
        call("issue_refund", {"order_id": order_id}, 1),
        say("Done: your refund is on its way. Thank you for your patience."),
    ]
    assert score(task, messages) == {
        "goal_resolved": (1.0, 1.0),
        "no_wrong_action": (1.0, 0.5),
        "politeness": (1.0, 0.1),
        "brevity": (1.0, 0.1),
    }


def test_weights_come_from_the_config():
    task = first_task(
        "refund", goal_resolved_weight=2.0, no_wrong_action_weight=1.0, politeness_weight=0.0, brevity_weight=0.3
    )
    weights = {name: weight for name, (_, weight) in score(task, [say("hi")]).items()}
    assert weights == {"goal_resolved": 2.0, "no_wrong_action": 1.0, "politeness": 0.0, "brevity": 0.3}


def test_refund_of_the_wrong_order_is_a_wrong_action():
    s = scenario_with_other_delivered_order("refund")
    task = customer_service.CustomerServiceTask(customer_service.CustomerServiceData(scenario=s, prompt=s.opening))
    wrong = call("issue_refund", {"order_id": other_order(s).order_id})
    right = call("issue_refund", {"order_id": s.goal.order_id}, 1)
    assert scores(task, [wrong, say("Refunded, thanks!")])["goal_resolved"] == 0.0
    assert scores(task, [wrong, say("Refunded, thanks!")])["no_wrong_action"] == 0.0
    both = scores(task, [wrong, right, say("Refunded, thanks!")])
    assert (both["goal_resolved"], both["no_wrong_action"]) == (1.0, 0.0)


def test_unrequested_actions_are_wrong():
    s = next(
        s
        for s in scenarios.generate_scenarios(50, seed=0, goals=("order_status",))
        if s.goal.order_id in {o.order_id for o in s.orders if o.status == "delivered"}
    )
    task = customer_service.CustomerServiceTask(customer_service.CustomerServiceData(scenario=s, prompt=s.opening))
    refund = call("issue_refund", {"order_id": s.goal.order_id})
    assert scores(task, [refund, say("It is refunded now, sorry.")]) == {
        "goal_resolved": 1.0,  # the status it now has was told
        "no_wrong_action": 0.0,
        "politeness": 1.0,
        "brevity": 1.0,
    }


def test_address_change_needs_the_customers_address():
    task = first_task("address_change")
    goal = task.data.scenario.goal
    retyped = goal.new_address.upper().replace(",", " ,")
    assert normalize_address(retyped) == normalize_address(goal.new_address)
    right = scores(task, [call("update_address", {"order_id": goal.order_id, "address": retyped}), say("Done.")])
    assert (right["goal_resolved"], right["no_wrong_action"]) == (1.0, 1.0)
    typo = call("update_address", {"order_id": goal.order_id, "address": "1 Nowhere Lane, Ashford"})
    wrong = scores(task, [typo, say("Done.")])
    assert (wrong["goal_resolved"], wrong["no_wrong_action"]) == (0.0, 0.0)


def test_order_status_must_be_told_exactly():
    task = first_task("order_status")
    status = next(o.status for o in task.data.scenario.orders if o.order_id == task.data.scenario.goal.order_id)
    other = next(word for word in ("processing", "shipped", "delivered") if word != status)
    assert scores(task, [say(f"Your order is {status.upper()}.")])["goal_resolved"] == 1.0
    assert scores(task, [say(f"Your order is {other}.")])["goal_resolved"] == 0.0
    assert scores(task, [say(f"It is {status} or maybe {other}.")])["goal_resolved"] == 0.0


def test_no_action_and_no_reply():
    task = first_task("refund")
    assert scores(task, [say("Please hold on.")]) == {
        "goal_resolved": 0.0,
        "no_wrong_action": 1.0,
        "politeness": 1.0,
        "brevity": 1.0,
    }
    silent = {"goal_resolved": 0.0, "no_wrong_action": 1.0, "politeness": 0.0, "brevity": 0.0}
    assert scores(task, []) == silent
    assert scores(task, [say(None), say("")]) == silent


@pytest.mark.parametrize(
    "message",
    [
        call("issue_refund", "{not json"),
        call("issue_refund", "[1, 2]"),
        call("issue_refund", '"W1234"'),
        call("issue_refund", ""),
        call("issue_refund", {"order": "W1234"}),
        call("issue_refund", {"order_id": None}),
        call("update_address", {"order_id": ["W1"], "address": {"street": 1}}),
        call("refund_everything", {"order_id": "W1234"}),
        call("", "{}"),
        say('<tool_call>{"name": "issue_refund", "arguments": {</tool_call>'),
        say("\x00\ufffd" * 200),
    ],
)
def test_malformed_output_scores_without_crashing(message):
    task = first_task("refund")
    result = scores(task, [message])
    assert result["goal_resolved"] == 0.0 and result["no_wrong_action"] == 1.0
    assert result["politeness"] == 0.0 and 0.0 <= result["brevity"] <= 1.0


def test_politeness_and_brevity():
    assert rewards.politeness(["Thank you!", "Sorry, whatever.", "Your order shipped.", "PLEASE wait"]) == 0.5
    assert rewards.politeness([]) == 0.0
    assert rewards.reply_brevity("one two three", 3) == 1.0
    assert rewards.reply_brevity("word " * 100, 50) == 0.5
    assert rewards.reply_brevity("  \n ", 50) == 0.0
    assert rewards.brevity(["short", "word " * 100], 50) == 0.75
    assert rewards.brevity([], 50) == 0.0


# --- the scripted customer


def chat(task, *messages: dict) -> list[dict]:
    """The harness's message list: system, the customer's opening, then ``messages``."""
    return [
        {"role": "system", "content": task.system_prompt},
        {"role": "user", "content": task.prompt},
        *messages,
    ]


def agent(content: str) -> dict:
    return {"role": "assistant", "content": content}


def agent_call(name: str, arguments: dict) -> dict:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": function}]}


def test_customer_reveals_facts_when_asked():
    task = first_task("address_change").data
    goal, person = task.scenario.goal, task.scenario.customer
    assert customer.scripted_reply(chat(task, agent("What is your order number?")), task) == (
        f"It's order {goal.order_id}."
    )
    reply = customer.scripted_reply(chat(task, agent("Which order, and what is the new address?")), task)
    assert reply == f"It's order {goal.order_id}. The new address is {goal.new_address}."
    assert customer.scripted_reply(chat(task, agent("Your name and e-mail?")), task) == (
        f"My name is {person.name}. My email is {person.email}."
    )
    assert customer.scripted_reply(chat(task, agent("Shall I go ahead?")), task) == "Yes, please go ahead."


def test_customer_keeps_facts_it_is_not_asked_for():
    task = first_task("refund").data
    for first_reply in ("Hello! How can I help?", "", "asdf qwer"):
        reply = customer.scripted_reply(chat(task, agent(first_reply)), task)
        assert reply == f"Can you refund my {task.scenario.goal.item}, please?"
        assert task.scenario.goal.order_id not in reply
    assert customer.scripted_reply(chat(task, agent("Your address?")), task) == "I don't need to change my address."


def test_customer_leaves_once_the_goal_is_met():
    task = first_task("refund").data
    order_id = task.scenario.goal.order_id
    asked = chat(task, agent("Your order number, please?"), {"role": "user", "content": f"It's order {order_id}."})
    assert customer.scripted_reply([*asked, agent("One moment.")], task) is not None
    done = [*asked, agent_call("issue_refund", {"order_id": order_id}), {"role": "tool", "content": "ok"}]
    assert customer.scripted_reply([*done, agent("Your refund is issued.")], task) is None


def test_customer_leaves_when_the_status_is_told():
    task = first_task("order_status").data
    status = next(o.status for o in task.scenario.orders if o.order_id == task.scenario.goal.order_id)
    assert customer.scripted_reply(chat(task, agent(f"It has been {status}.")), task) is None
    wrong = next(word for word in ("processing", "shipped", "delivered") if word != status)
    assert customer.scripted_reply(chat(task, agent(f"It has been {wrong}.")), task) is not None


def test_transcript_reads_both_message_shapes():
    dicts = [agent("hi"), agent_call("lookup_order", {"order_id": "W1"}), {"role": "user", "content": "x"}]
    objects = [say("hi"), call("lookup_order", {"order_id": "W1"})]
    assert tool_calls(dicts) == tool_calls(objects) == [("lookup_order", '{"order_id": "W1"}')]
    assert agent_replies(dicts) == agent_replies(objects) == ["hi"]


# --- the model-played customer


def model_task(**config):
    return first_task("address_change", customer="model", customer_model="tiny", **config).data


def test_model_customer_sees_the_conversation_from_its_side():
    task = model_task()
    messages = chat(task, agent("Order number?"), {"role": "user", "content": "W1"}, agent_call("lookup_order", {}))
    chat_for_customer = model_customer.customer_messages([*messages, agent("Thanks.")], task.scenario)
    assert [m["role"] for m in chat_for_customer] == ["system", "assistant", "user", "assistant", "user"]
    persona = chat_for_customer[0]["content"]
    assert task.scenario.goal.order_id in persona and task.scenario.goal.new_address in persona
    assert [m["content"] for m in chat_for_customer[1:]] == [task.prompt, "Order number?", "W1", "Thanks."]


def test_model_customer_calls_the_server(monkeypatch):
    task = model_task(customer_base_url="http://server:1/v1/", customer_max_tokens=7)
    monkeypatch.setenv("TRIDENT_API_KEY", "sekrit")
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer sekrit"
        seen.append((str(request.url), json.loads(request.content)))
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": " It's W1. "}}]})

    async def reply(messages, handler):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await model_customer.model_reply(messages, task, client)

    assert asyncio.run(reply(chat(task, agent("Order number?")), answer)) == "It's W1."
    url, body = seen[0]
    assert url == "http://server:1/v1/chat/completions"
    assert (body["model"], body["max_tokens"], body["messages"][-1]) == (
        "tiny",
        7,
        {"role": "user", "content": "Order number?"},
    )

    empty = lambda request: httpx.Response(200, json={"choices": [{"message": {"content": None}}]})  # noqa: E731
    assert asyncio.run(reply(chat(task, agent("Your address?")), empty)).startswith("The new address is")

    failing = lambda request: httpx.Response(404, text="no such model")  # noqa: E731
    with pytest.raises(RuntimeError, match="customer model at http://server:1/v1/chat/completions answered 404"):
        asyncio.run(reply(chat(task, agent("Hi")), failing))

    goal = task.scenario.goal
    done = chat(task, agent_call("update_address", {"order_id": goal.order_id, "address": goal.new_address}))
    assert asyncio.run(reply([*done, agent("Done.")], failing)) is None  # the goal is met: no call


# --- a whole rollout through the harness, with a scripted agent


def scripted_endpoint(script: list[dict], seen: list[list[dict]], offered: list[list[dict]]) -> web.Application:
    """An OpenAI chat-completions endpoint answering each call with the next scripted message."""
    replies = iter(script)

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body["messages"])
        offered.append(body.get("tools", []))
        choice = {"index": 0, "finish_reason": "stop", "message": next(replies)}
        return web.json_response({"id": "x", "object": "chat.completion", "model": body["model"], "choices": [choice]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    return app


def test_a_rollout_through_the_harness():
    task = first_task("refund", max_turns=6).data
    order_id = task.scenario.goal.order_id
    script = [
        agent("Sorry about that! What is your order number?"),
        agent_call("lookup_order", {"order_id": order_id}),
        agent_call("issue_refund", {"order_id": order_id}),
        agent("Your refund is done. Thank you!"),
        agent("This turn is never asked for."),
    ]
    seen: list[list[dict]] = []
    offered: list[list[dict]] = []
    runtime = Runtime()
    agent_harness = harness.InProcessHarness(harness.InProcessHarnessConfig())
    ctx = type("Ctx", (), {"model": "m"})()

    async def launch():
        async with TestServer(scripted_endpoint(script, seen, offered)) as server:
            endpoint = str(server.make_url("/v1"))
            return await agent_harness.launch(ctx, None, runtime, endpoint, "k", {}, task)

    result = asyncio.run(launch())
    assert result.exit_code == 0
    assert len(seen) == 4  # the customer left after the refund was confirmed
    assert seen[1][-1] == {"role": "user", "content": f"It's order {order_id}."}
    assert seen[3][-1]["role"] == "tool" and seen[3][-1]["content"].startswith("Refunded $")
    assert tools.rollout_store(runtime, task).orders[order_id].status == "refunded"
    assert [tool["function"]["name"] for tool in offered[0]] == list(TOOL_NAMES)


# --- the configs


def test_configs_resolve_and_the_env_accepts_their_args():
    configs = Path(__file__).parents[3] / "configs" / "customer-service" / "rl"
    argv = ["--trainer", "@", str(configs / "train.toml"), "--orchestrator", "@", str(configs / "orch.toml"),
            "--inference", "@", str(configs / "infer.toml")]  # fmt: skip
    config = resolve_shared(parse_config(RLConfig, argv))
    assert {config.trainer.model.name, config.orchestrator.model.name, config.inference.model.name} == {"Qwen/Qwen3-4B"}
    assert config.trainer.seq_len == config.inference.model.max_model_len == 4096
    assert config.inference.model.enable_auto_tool_choice and config.inference.model.tool_call_parser == "hermes"
    assert config.trainer.model.experimental.lora is not None
    (env,) = config.orchestrator.env
    assert env.id == "customer-service"
    assert customer_service.CustomerServiceConfig(**env.args).max_turns == 8
