import asyncio
import json
import sys
import types
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import recursive_reasoner
import verifiers.v1 as vf
from pydantic import ValidationError
from recursive_reasoner import RecursiveReasonerConfig, RecursiveReasonerTaskset
from recursive_reasoner.independence import (
    cosine_distance,
    independence_measure,
    jaccard_distance,
    lexical_independence,
    word_set,
)
from recursive_reasoner.outcome import evaluate
from recursive_reasoner.plan import MalformedPlan, Plan, parse_plan, strip_thinking
from recursive_reasoner.worker import ServerWorker, WorkerCall, WorkerError, WorkerSettings, solve
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, ModelCall, TraceTask

from contracts.config import parse_config
from launch.rl_config import RLConfig, resolve_shared
from orchestrator.config import EnvConfig
from orchestrator.verifiers_adapter.envs import load_env

BASE = "base/model"
DIRECT = {"should_decompose": False, "subproblems": [], "plan": "Multiply, then subtract."}
SPLIT = {
    "should_decompose": True,
    "subproblems": ["How much do 4 packs at $3 cost?", "How many dollars are in two $10 bills?"],
    "plan": "Subtract the cost from the money.",
}


def taskset(**config) -> list[recursive_reasoner.RecursiveReasonerTask]:
    return list(RecursiveReasonerTaskset(RecursiveReasonerConfig(worker_model=BASE, **config)))


class FakeWorker:
    """Stands in for the server: answers each call with the next scripted reply, and keeps what it was asked."""

    def __init__(self, *replies: str, tokens: int = 10) -> None:
        self.replies, self.tokens = list(replies), tokens
        self.asked: list[tuple[str, list[dict]]] = []

    async def __call__(self, stage, messages) -> WorkerCall:
        self.asked.append((stage, messages))
        reply = self.replies.pop(0)
        return WorkerCall(stage=stage, model=BASE, served_model=BASE, reply=reply, prompt_tokens=50,
                          completion_tokens=self.tokens)  # fmt: skip


# --- the planner's JSON


def test_parse_plan_reads_both_kinds_of_plan():
    assert parse_plan(json.dumps(DIRECT), 4) == Plan(should_decompose=False, plan="Multiply, then subtract.")
    plan = parse_plan(json.dumps({**SPLIT, "subproblems": ["  a b ", "c"], "extra": 1}), 2)
    assert plan == Plan(should_decompose=True, subproblems=("a b", "c"), plan=SPLIT["plan"])


@pytest.mark.parametrize(
    "reply",
    [
        json.dumps(DIRECT),
        f"<think>\nLet me see {{}}.\n</think>\n\n{json.dumps(DIRECT)}",
        f"Here is my plan:\n```json\n{json.dumps(DIRECT, indent=2)}\n```\nDone.",
        f"```\n{json.dumps(DIRECT)}```",
    ],
)
def test_parse_plan_accepts_thinking_and_a_fenced_block(reply):
    assert parse_plan(reply, 4).plan == DIRECT["plan"]


@pytest.mark.parametrize(
    "reply, reason",
    [
        ("", "no JSON object"),
        ("I would split it in two.", "no JSON object"),
        (json.dumps(DIRECT) + " and more", "no JSON object"),
        ('{"should_decompose": false, "subproblems": [], "plan": "x"', "no JSON object"),
        (f"<think>{json.dumps(DIRECT)}", "no JSON object"),  # the JSON is inside unfinished thinking
        ("[1, 2]", "expected a JSON object, got a JSON list"),
        ('"plan"', "expected a JSON object, got a JSON str"),
        (json.dumps({"should_decompose": False, "subproblems": []}), "missing key 'plan'"),
        (json.dumps({**DIRECT, "should_decompose": "false"}), "'should_decompose' must be a boolean"),
        (json.dumps({**DIRECT, "should_decompose": 0}), "'should_decompose' must be a boolean"),
        (json.dumps({**DIRECT, "subproblems": "a, b"}), "'subproblems' must be a list"),
        (json.dumps({**DIRECT, "plan": None}), "'plan' must be a string"),
        (json.dumps({**SPLIT, "subproblems": ["a", 2]}), "non-empty strings only"),
        (json.dumps({**SPLIT, "subproblems": ["a", "  "]}), "non-empty strings only"),
        (json.dumps({**SPLIT, "subproblems": ["a"]}), "expected 2 to 4 subproblems, got 1"),
        (json.dumps({**SPLIT, "subproblems": list("abcde")}), "expected 2 to 4 subproblems, got 5"),
        (json.dumps({**DIRECT, "subproblems": ["a", "b"]}), "should_decompose is false but 2 subproblems"),
        ("\x00\ufffd{" * 100, "no JSON object"),
    ],
)
def test_malformed_plans_say_why(reply, reason):
    with pytest.raises(MalformedPlan, match=reason):
        parse_plan(reply, 4)


def test_strip_thinking():
    assert strip_thinking("<think>a</think>\n\n#### 4") == "#### 4"
    assert strip_thinking("reasoning</think> #### 4") == "#### 4"  # thinking opened by the prompt
    assert strip_thinking("#### 4 <think>cut off") == "#### 4"
    assert strip_thinking(" plain ") == "plain"


# --- independence


def test_lexical_independence_is_the_mean_jaccard_distance_of_word_sets():
    assert word_set("Ben buys 5 pens, then 5 more!") == {"ben", "buys", "5", "pens", "then", "more"}
    assert jaccard_distance(frozenset("ab"), frozenset("bc")) == pytest.approx(1 - 1 / 3)
    assert jaccard_distance(frozenset(), frozenset()) == 0.0
    assert lexical_independence(["the cost of pens", "the cost of pens"]) == 0.0
    assert lexical_independence(["red apples", "blue cars"]) == 1.0
    # pairs: (a b, b c) 2/3, (a b, d) 1, (b c, d) 1
    assert lexical_independence(["a b", "b c", "d"]) == pytest.approx((2 / 3 + 1 + 1) / 3)
    assert lexical_independence(["only one"]) == lexical_independence([]) == 0.0
    assert independence_measure(None) is lexical_independence


def test_cosine_distance():
    assert cosine_distance([1.0, 0.0], [2.0, 0.0]) == pytest.approx(0.0)
    assert cosine_distance([1.0, 0.0], [0.0, 3.0]) == pytest.approx(1.0)
    assert cosine_distance([1.0, 0.0], [-1.0, 0.0]) == 1.0  # clipped
    assert cosine_distance([0.0, 0.0], [1.0, 0.0]) == 1.0


def test_embedding_measure_uses_the_local_sentence_transformers_model(monkeypatch):
    loaded = []

    class SentenceTransformer:
        def __init__(self, path, local_files_only):
            loaded.append((path, local_files_only))

        def encode(self, texts):
            return [[1.0, 0.0] if "apples" in text else [0.0, 1.0] for text in texts]

    monkeypatch.setitem(
        sys.modules, "sentence_transformers", types.SimpleNamespace(SentenceTransformer=SentenceTransformer)
    )
    independence_measure.cache_clear()
    try:
        measure = independence_measure("/models/minilm")
        assert measure(["apples", "green apples", "pears"]) == pytest.approx((0 + 1 + 1) / 3)
        assert measure(["apples"]) == 0.0
        assert independence_measure("/models/minilm") is measure and loaded == [("/models/minilm", True)]
    finally:
        independence_measure.cache_clear()


def test_embedding_measure_without_the_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    independence_measure.cache_clear()
    with pytest.raises(ImportError, match=r"uv pip install sentence-transformers"):
        RecursiveReasonerTaskset(RecursiveReasonerConfig(worker_model=BASE, embedding_model_path="/models/x"))


# --- the worker


def test_direct_plan_is_one_call_with_the_plan():
    worker = FakeWorker("#### 3")
    calls = asyncio.run(solve("Q?", Plan(should_decompose=False, plan="Just add."), worker))
    assert [c.stage for c in calls] == ["direct"]
    ((stage, messages),) = worker.asked
    assert [m["role"] for m in messages] == ["system", "user"] and "####" in messages[0]["content"]
    assert messages[1]["content"] == "Problem: Q?\n\nPlan: Just add."


def test_decomposed_plan_solves_each_part_then_combines():
    worker = FakeWorker("<think>hm</think>12", "20", "#### 8")
    plan = Plan(should_decompose=True, subproblems=("Cost of 4 packs at $3?", "Two $10 bills?"), plan="Subtract.")
    calls = asyncio.run(solve("Q?", plan, worker))
    assert [c.stage for c in calls] == ["subproblem", "subproblem", "combine"]
    parts = [messages[1]["content"] for _, messages in worker.asked[:2]]
    assert parts == [
        "This is part of a larger problem:\nQ?\n\nSolve only this part:\nCost of 4 packs at $3?",
        "This is part of a larger problem:\nQ?\n\nSolve only this part:\nTwo $10 bills?",
    ]
    combine = worker.asked[2][1][1]["content"]
    assert combine.startswith("Problem: Q?\n\nPlan: Subtract.\n\n")
    assert (
        "Part 1: Cost of 4 packs at $3?\nSolution: 12" in combine and "Part 2: Two $10 bills?\nSolution: 20" in combine
    )
    assert "<think>" not in combine


def test_server_worker_calls_the_chat_route_with_the_worker_model(monkeypatch):
    monkeypatch.setenv("TRIDENT_API_KEY", "sekrit")
    settings = WorkerSettings(base_url="http://server:1/v1/", model=BASE, max_tokens=7, temperature=0.0,
                              enable_thinking=False)  # fmt: skip
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer sekrit"
        seen.append((str(request.url), json.loads(request.content)))
        body = {"model": BASE, "choices": [{"message": {"role": "assistant", "content": "#### 5"}}],
                "usage": {"prompt_tokens": 30, "completion_tokens": 4}}  # fmt: skip
        return httpx.Response(200, json=body)

    async def call(handler):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await ServerWorker(settings, client)("direct", [{"role": "user", "content": "Q"}])

    assert asyncio.run(call(answer)) == WorkerCall(
        stage="direct", model=BASE, served_model=BASE, reply="#### 5", prompt_tokens=30, completion_tokens=4
    )
    url, body = seen[0]
    assert url == "http://server:1/v1/chat/completions"
    assert body == {"model": BASE, "messages": [{"role": "user", "content": "Q"}], "max_tokens": 7,
                    "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    failing = lambda request: httpx.Response(404, text="model does not exist")  # noqa: E731
    with pytest.raises(WorkerError, match="worker model 'base/model' at http://server:1/v1/chat/completions .* 404"):
        asyncio.run(call(failing))


# --- outcomes and rewards


def test_evaluate_checks_the_final_answer_and_counts_tokens():
    worker = FakeWorker("12", "20", "So 8.\n#### 8", tokens=5)
    outcome = asyncio.run(evaluate("Q?", "8", json.dumps(SPLIT), worker, lexical_independence, 4, planner_tokens=40))
    assert outcome.correct and outcome.final_answer == "8" and outcome.decomposed and outcome.malformed is None
    assert outcome.tokens == 40 + 3 * 5
    assert outcome.independence == pytest.approx(lexical_independence(SPLIT["subproblems"]))
    assert 0 < outcome.independence < 1
    assert outcome.token_efficiency(100) == pytest.approx(0.45) and outcome.token_efficiency(10) == 0.0

    wrong = asyncio.run(evaluate("Q?", "8", json.dumps(DIRECT), FakeWorker("#### 8.5"), lexical_independence, 4))
    assert not wrong.correct and wrong.final_answer == "8.5" and not wrong.decomposed and wrong.independence == 0.0


def test_a_malformed_plan_makes_no_worker_call():
    worker = FakeWorker()
    outcome = asyncio.run(evaluate("Q?", "8", "{oops", worker, lexical_independence, 4, planner_tokens=64))
    assert outcome.malformed == "no JSON object in the reply" and worker.asked == [] and outcome.calls == []
    assert (outcome.correct, outcome.independence, outcome.token_efficiency(2048)) == (False, 0.0, 0.0)


def planner_trace(task, reply: str, completion_tokens: int = 20) -> vf.Trace:
    """A finished planner turn: the prompt, the reply, and its model call as the training client records it."""
    nodes = [
        MessageNode(message=vf.UserMessage(content=task.data.prompt)),
        MessageNode(parent=0, sampled=True, message=vf.AssistantMessage(content=reply)),
    ]
    call = ModelCall(
        node=1, model="lora-step-3", usage=vf.Usage(prompt_tokens=300, completion_tokens=completion_tokens)
    )
    return vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data),
        agent=AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())),
        nodes=nodes,
        calls=[call],
    )


def run_rollout_end(task, reply: str, worker: FakeWorker, monkeypatch) -> vf.Trace:
    """What verifiers does once the planner answered: the task's finalize (with ``worker``), then scoring."""

    @asynccontextmanager
    async def fake_server_worker(settings):
        assert settings == task.data.worker
        yield worker

    monkeypatch.setattr(recursive_reasoner, "server_worker", fake_server_worker)
    trace = planner_trace(task, reply)
    asyncio.run(task.finalize(trace, None))
    asyncio.run(task.score(trace))
    return trace


def test_rewards_metrics_and_the_recorded_worker_calls(monkeypatch, tmp_path):
    log = tmp_path / "worker.jsonl"
    (task,) = taskset(num_examples=1, token_budget=100, log_path=str(log))
    reply = json.dumps(SPLIT)
    trace = run_rollout_end(task, reply, FakeWorker("12", "20", f"#### {task.data.answer}", tokens=10), monkeypatch)
    independence = lexical_independence(SPLIT["subproblems"])
    assert {name: (r.score, r.weight) for name, r in trace.rewards.items()} == {
        "correct": (1.0, 1.0),
        "token_efficiency": (pytest.approx(1 - (20 + 30) / 100), 0.2),
        "independence": (pytest.approx(independence), 0.3),
    }
    assert trace.reward == pytest.approx(1.0 + 0.2 * 0.5 + 0.3 * independence)
    assert trace.metrics == {"malformed": 0.0, "decomposed": 1.0, "subproblems": 2.0, "tokens": 50.0}
    # every worker call named the base model, and the server answered as the base model; the planner ran on the adapter
    recorded = trace.info["recursive_reasoner"]
    assert recorded["planner_model"] == "lora-step-3"
    assert [(c["stage"], c["model"], c["served_model"]) for c in recorded["calls"]] == [
        ("subproblem", BASE, BASE),
        ("subproblem", BASE, BASE),
        ("combine", BASE, BASE),
    ]
    assert [u.completion_tokens for u in trace.extra_usage] == [10, 10, 10]
    assert trace.usage.completion_tokens == 20  # the agent's (planner's) usage alone
    (line,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert line["task"] == task.data.id and line["rollout"] == trace.id and line["tokens"] == 50
    assert line["calls"] == recorded["calls"] and line["plan"]["subproblems"] == SPLIT["subproblems"]


def test_malformed_plan_scores_zero_and_is_counted(monkeypatch):
    (task,) = taskset(num_examples=1)
    trace = run_rollout_end(task, '{"should_decompose": "yes"', FakeWorker(), monkeypatch)
    assert {name: r.score for name, r in trace.rewards.items()} == {
        "correct": 0.0,
        "token_efficiency": 0.0,
        "independence": 0.0,
    }
    assert trace.reward == 0.0
    assert trace.metrics == {"malformed": 1.0, "decomposed": 0.0, "subproblems": 0.0, "tokens": 20.0}
    assert trace.info["recursive_reasoner"]["calls"] == [] and trace.extra_usage == []


def test_direct_plan_with_a_wrong_answer_earns_only_token_efficiency(monkeypatch):
    (task,) = taskset(num_examples=1, token_budget=200)
    trace = run_rollout_end(task, json.dumps(DIRECT), FakeWorker("#### -1", tokens=30), monkeypatch)
    assert {name: r.score for name, r in trace.rewards.items()} == {
        "correct": 0.0,
        "token_efficiency": pytest.approx(1 - 50 / 200),
        "independence": 0.0,
    }
    assert trace.metrics["decomposed"] == 0.0 and trace.metrics["malformed"] == 0.0


def test_reward_weights_come_from_the_config(monkeypatch):
    (task,) = taskset(num_examples=1, correctness_weight=2.0, token_weight=0.0, independence_weight=0.5)
    trace = run_rollout_end(task, json.dumps(DIRECT), FakeWorker(f"#### {task.data.answer}"), monkeypatch)
    assert {name: r.weight for name, r in trace.rewards.items()} == {
        "correct": 2.0,
        "token_efficiency": 0.0,
        "independence": 0.5,
    }
    assert trace.reward == pytest.approx(2.0)


def test_scoring_before_finalize_is_an_error():
    (task,) = taskset(num_examples=1)
    trace = planner_trace(task, json.dumps(DIRECT))
    with pytest.raises(Exception, match="score a trace after RecursiveReasonerTask.finalize"):
        asyncio.run(task.score(trace))


# --- the taskset


def test_taskset_builds_planner_tasks_from_the_generator():
    tasks = taskset(num_examples=5, seed=3, max_subproblems=3, worker_max_tokens=64)
    assert [t.data.prompt for t in tasks] == [t.data.prompt for t in taskset(num_examples=5, seed=3)]
    assert len({t.data.id for t in tasks}) == 5
    data = tasks[0].data
    assert "JSON" in data.system_prompt and "2 to 3 subproblems" in data.system_prompt
    assert data.worker == WorkerSettings(base_url="http://127.0.0.1:8000/v1", model=BASE, max_tokens=64,
                                         temperature=0.0, enable_thinking=False)  # fmt: skip
    assert not hasattr(data, "tools")  # one planner turn, no tools: the harness's defaults


def test_taskset_reads_gsm8k_from_dataset_path(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"steps\n#### {i}"}) for i in range(3)))
    tasks = taskset(dataset_path=str(path), num_examples=2)
    assert [(t.data.prompt, t.data.answer, t.data.source) for t in tasks] == [
        ("q0", "0", "gsm8k"),
        ("q1", "1", "gsm8k"),
    ]


def test_worker_model_is_required():
    with pytest.raises(ValidationError, match="worker_model"):
        RecursiveReasonerConfig()


def test_exactly_one_taskset_is_exported_and_loads_by_id():
    exported = [getattr(recursive_reasoner, name) for name in recursive_reasoner.__all__]
    assert [c for c in exported if isinstance(c, type) and issubclass(c, vf.Taskset)] == [RecursiveReasonerTaskset]
    env = load_env(EnvConfig(id="recursive-reasoner", args={"worker_model": BASE, "num_examples": 2}))
    assert isinstance(env.taskset, RecursiveReasonerTaskset) and len(list(env.taskset)) == 2


def test_configs_resolve_with_a_lora_planner_and_the_base_model_as_worker():
    configs = Path(__file__).parents[3] / "configs" / "recursive-reasoner" / "rl"
    argv = ["--trainer", "@", str(configs / "train.toml"), "--orchestrator", "@", str(configs / "orch.toml"),
            "--inference", "@", str(configs / "infer.toml")]  # fmt: skip
    config = resolve_shared(parse_config(RLConfig, argv))
    model = config.orchestrator.model.name
    assert {config.trainer.model.name, config.inference.model.name} == {model}
    lora = config.trainer.model.experimental.lora
    assert lora is not None and lora.export == "adapter"
    assert config.inference.lora is not None and config.inference.lora.max_rank >= lora.rank
    (env,) = config.orchestrator.env
    env_config = RecursiveReasonerConfig(**env.args)
    assert env.id == "recursive-reasoner" and env_config.worker_model == model
    assert env_config.worker_base_url == f"http://127.0.0.1:{config.inference.port}/v1"
