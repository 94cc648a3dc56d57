"""[env.judge]: a model scores each completion, and its score joins the environment's rewards. Against a local server
that plays both the policy (token in/token out, always replying "hi") and the judge (chat completions, scripted):
the judge's request, its reply read as a score, and its failures retried and counted as infrastructure errors."""

import asyncio
import logging
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import verifiers.v1 as vf
from fake_policy import FakePolicy, PolicyHandler, serving

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.inference_api import CHAT_COMPLETIONS, GENERATE
from contracts.model_path import TINY_MODEL_ID
from orchestrator.batching.infra import infra_metrics
from orchestrator.config import EnvConfig, EvalConfig, JudgeConfig, OrchestratorConfig
from orchestrator.loop.evaluation import load_eval_sets
from orchestrator.loop.run import Orchestrator
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.harness import InProcessHarness
from orchestrator.verifiers_adapter.judge import JudgeError, check_judged, constraint, parse_score
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.tiny_model import built_model_path

CLOSED = "http://127.0.0.1:9/v1"  # nothing listens there
ENV_ID = "trident-test-judge"  # this module is the environment of this id: a taskset that drops its task config
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])


class UnconfiguredTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class UnconfiguredTaskset(vf.Taskset[UnconfiguredTask, vf.TasksetConfig]):
    def load(self):
        yield UnconfiguredTask(vf.TaskData(id="t0", prompt="Say hi."))  # not self.config.task: no judge reaches it


__all__ = ["InProcessHarness", "UnconfiguredTaskset"]


class PolicyAndJudge(FakePolicy):
    """The policy replies "hi"; the judge gives its ``script``'s answers in turn (the last one again when they run
    out): a reply's text, an HTTP status to fail with, or None to hang until the server stops."""

    def __init__(self, script: list[str | int | None]):
        super().__init__(Handler)
        self.script, self.judge_requests, self.stopping = script, [], threading.Event()

    def judge_answer(self) -> str | int | None:
        return self.script[min(len(self.judge_requests) - 1, len(self.script) - 1)]


class Handler(PolicyHandler):
    server: PolicyAndJudge

    def do_POST(self) -> None:
        body = self.read_json()
        if self.path == GENERATE:
            return self.respond(200, self.server.hi)
        assert self.path == CHAT_COMPLETIONS, self.path
        self.server.judge_requests.append({**body, "authorization": self.headers["Authorization"]})
        answer = self.server.judge_answer()
        if answer is None:
            self.server.stopping.wait()
        elif isinstance(answer, int):
            self.respond(answer, {"error": {"message": "the judge is overloaded"}})
        else:
            message = {"role": "assistant", "content": answer}
            self.respond(200, {"id": "judged", "object": "chat.completion", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})  # fmt: skip


@contextmanager
def policy_and_judge(*script: str | int | None) -> Iterator[PolicyAndJudge]:
    with serving(PolicyAndJudge(list(script))) as server:
        try:
            yield server
        finally:
            server.stopping.set()  # before the server stops: it waits for its hanging answers


def judged_rollouts(server: PolicyAndJudge, n: int, judge: dict, max_retries: int = 0):
    """``n`` rollouts of reverse-text's first task ("Reverse the following text, character by character: forest
    window"),
    the policy served by ``server``, judged as ``judge`` says."""
    env = load_env(EnvConfig(id="reverse-text", args={"num_examples": 1}, judge=judge))
    ctx = model_context(OrchestratorConfig(client={"base_url": server.base_url}), built_model_path(TINY_MODEL_ID))
    limits = RolloutLimits.of(rollouts=n, max_retries=max_retries, backoff_s=0.01)

    async def run():
        async with env.serving():
            return await run_group(env, next(iter(env.taskset.load())), n, ctx, limits)

    return asyncio.run(run())


SIMILARITY_OF_HI = 2 * 1 / 15  # difflib's ratio of "hi" and "wodniw tserof": 2 × 1 matching ("i") / 15 characters


def test_the_judges_score_joins_the_rewards_and_it_sees_the_filled_template():
    template = "Q: {prompt}\nA: {completion}\nGold: {answer}\nRight? yes or no"
    with policy_and_judge("Verdict: yes") as server:
        rollouts = judged_rollouts(server, 2, {"prompt": template, "answer_field": "text", "weight": 0.5})
    assert all(r.ok for r in rollouts), [r.error for r in rollouts]
    assert [r.rewards for r in rollouts] == [{"similarity": SIMILARITY_OF_HI, "judge": 1.0}] * 2
    assert [r.reward for r in rollouts] == [SIMILARITY_OF_HI + 0.5 * 1.0] * 2
    request = server.judge_requests[0]
    prompt = "Reverse the following text, character by character: forest window"
    content = f"Q: {prompt}\nA: hi\nGold: forest window\nRight? yes or no"
    assert request["messages"] == [{"role": "user", "content": content}]
    assert request["model"] == TINY_MODEL_ID  # by default the model the rollout sampled from, on its server
    assert (request["max_tokens"], request["temperature"]) == (64, 0.0)
    assert "structured_outputs" not in request


def test_a_numeric_judge_on_another_url_scores_its_number_over_the_scale_and_gets_no_run_key(monkeypatch):
    monkeypatch.setenv("TRIDENT_API_KEY", "the-run-key")
    with policy_and_judge("Score: 7/10") as judge, policy_and_judge() as policy:
        judge_config = {"url": f"{judge.base_url}/v1", "model": "grader", "parse": "number", "max_score": 10,
                        "max_tokens": 8, "constrain": True}  # fmt: skip
        (rollout,) = judged_rollouts(policy, 1, judge_config)
    assert rollout.ok, rollout.error
    assert rollout.rewards["judge"] == pytest.approx(0.7)
    (request,) = judge.judge_requests
    assert request["model"] == "grader" and request["max_tokens"] == 8
    assert request["structured_outputs"] == {"regex": r"(0|1|2|3|4|5|6|7|8|9)(\.\d{1,3})?|10(\.0{1,3})?"}
    assert request["authorization"] == "Bearer EMPTY"  # the run's key is for the run's servers only
    assert "0 (not at all) to 10 (perfectly)" in request["messages"][0]["content"]  # the default template


def test_the_run_key_goes_to_a_judge_on_the_runs_server(monkeypatch):
    monkeypatch.setenv("TRIDENT_API_KEY", "the-run-key")
    with policy_and_judge("no") as server:
        (rollout,) = judged_rollouts(server, 1, {"constrain": True})
    assert rollout.ok and rollout.rewards["judge"] == 0.0, rollout.error
    (request,) = server.judge_requests
    assert request["authorization"] == "Bearer the-run-key"
    assert request["structured_outputs"] == {"choice": ["yes", "no"]}


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("yes", 1.0),
        ("No.", 0.0),
        ("The reply is wrong, so no... Verdict: YES", 1.0),  # a verdict line wins
        ("Is it reversed? Yes, but the case: no", 0.0),  # else the last word of the two
        ("<think>yes, surely</think>no", 0.0),  # thinking is not the verdict
    ],
)
def test_a_yes_no_verdict_is_one_or_zero(reply, score):
    assert parse_score(reply, JudgeConfig()) == score


@pytest.mark.parametrize(
    ("reply", "max_score", "score"),
    [("0.25", 1, 0.25), ("Score: 1", 1, 1.0), ("8/10", 10, 0.8), ("Step 1 is fine, step 2 not: 3", 10, 0.3)],
)
def test_a_number_is_the_last_one_over_the_scale(reply, max_score, score):
    assert parse_score(reply, JudgeConfig(parse="number", max_score=max_score)) == pytest.approx(score)


@pytest.mark.parametrize(
    ("reply", "parse"),
    [("maybe", "yes_no"), ("", "yes_no"), ("<think>yes", "yes_no"), ("great", "number"), ("11", "number"),
     ("-0.5", "number"), ("1.5", "number")],
)  # fmt: skip
def test_a_reply_without_a_verdict_is_a_judge_error_not_a_score(reply, parse):
    with pytest.raises(JudgeError, match="the judge's reply holds no"):
        parse_score(reply, JudgeConfig(parse=parse))


def test_a_constrained_judge_can_only_reply_what_reads_as_a_score():
    config = JudgeConfig(parse="number", max_score=10)
    pattern = constraint(config)["regex"]
    for reply, score in [("0", 0.0), ("7", 0.7), ("9.25", 0.925), ("10", 1.0), ("10.00", 1.0)]:
        assert re.fullmatch(pattern, reply) and parse_score(reply, config) == pytest.approx(score)
    for reply in ["11", "10.5", "100", "-1", "1e3", "7/10", "07.5.1", ""]:
        assert not re.fullmatch(pattern, reply), reply
    assert constraint(JudgeConfig())["choice"] == ["yes", "no"]


def test_a_judge_failing_once_runs_the_rollout_again_and_is_counted():
    with policy_and_judge(503, "yes") as server:
        (rollout,) = judged_rollouts(server, 1, {}, max_retries=2)
    assert rollout.ok and not rollout.lost and rollout.retries == 1, rollout.error
    assert rollout.rewards["judge"] == 1.0
    assert infra_metrics([[rollout]])["infra/reverse-text/retries"] == 1


@pytest.mark.parametrize(
    ("script", "judge", "error"),
    [
        (["maybe"], {}, "JudgeError: the judge's reply holds no yes/no verdict: 'maybe'"),
        ([500], {}, f"JudgeError: the judge (model '{TINY_MODEL_ID}' at {{url}}/v1) failed: InternalServerError: "),
        ([None], {"timeout_s": 0.2}, "JudgeError: the judge (model 'grader' at {url}/v1) failed: APITimeoutError: "),
    ],
    ids=["unparseable", "http-500", "timeout"],
)
def test_a_judge_that_keeps_failing_loses_the_group_and_never_scores_zero(script, judge, error, caplog):
    with policy_and_judge(*script) as server, caplog.at_level(logging.WARNING, logger="orchestrator"):
        if "timeout_s" in judge:
            judge = {**judge, "url": f"{server.base_url}/v1", "model": "grader"}
        rollouts = judged_rollouts(server, 2, judge, max_retries=2)
        assert len(server.judge_requests) == 2 * 3  # each rollout, and its 2 retries
    # each retry round of the group is one line in the log while it runs, not silence until the step ends
    said = [record.getMessage() for record in caplog.records if "its rollouts run again" in record.getMessage()]
    assert [line.split(" (retry ")[1].split(")")[0] for line in said] == ["1 of 2", "2 of 2"], said
    assert all(line.startswith("environment 'reverse-text', task ") for line in said), said
    assert error.format(url=server.base_url) in said[0]
    assert all(r.lost and not r.ok and r.retries == 2 for r in rollouts)
    assert all(r.error.startswith(error.format(url=server.base_url)) for r in rollouts), rollouts[0].error
    counted = {name: value for name, value in infra_metrics([rollouts]).items() if "setup_s" not in name}
    assert counted == {"infra/reverse-text/retries": 4, "infra/reverse-text/lost_rollouts": 2,
                       "infra/reverse-text/lost_groups": 1}  # fmt: skip


def test_a_step_whose_judge_is_unreachable_fails_naming_the_judge(tmp_path, on_weights_server):
    with policy_and_judge() as policy:
        config = OrchestratorConfig(
            output_dir=tmp_path, batch_size=1, rollouts_per_example=2, sample_rollouts_every=0,
            env=[{"id": "reverse-text", "judge": {"url": CLOSED, "model": "grader"}}],
            client={"base_url": policy.base_url}, infra={"max_retries": 1, "retry_backoff_s": 0.01},
        )  # fmt: skip
        orchestrator, _ = on_weights_server(config)

        async def step():
            async with orchestrator.envs[0].serving():
                await orchestrator.step(1)

        cause = f"JudgeError: the judge (model 'grader' at {CLOSED}) failed: APIConnectionError"
        with pytest.raises(TridentError, match=rf"^step 1: 1 of 1 groups lost .* after 1 retries: {re.escape(cause)}"):
            asyncio.run(step())


def test_judge_settings_that_cannot_work_are_refused_in_one_line(tmp_path):
    path = tmp_path / "orch.toml"
    for table, error in [
        ('prompt = "Is {completion} {right}?"', r"env\.0\.judge\.prompt: unknown placeholder \{right\}"),
        ('prompt = "Is this right: {prompt}?"', r"env\.0\.judge\.prompt: the judge's prompt has no \{completion\}"),
        ('parse = "stars"', r"env\.0\.judge\.parse: Input should be 'yes_no' or 'number'"),
        (
            'url = "localhost:8001/v1"',
            r"env\.0\.judge\.url: 'localhost:8001/v1' is not an http\(s\) URL; write its "
            r"scheme, e\.g\. 'http://localhost:8001/v1'$",
        ),
    ]:
        path.write_text(f'[[env]]\nid = "reverse-text"\n[env.judge]\n{table}\n')
        with pytest.raises(ConfigError, match=rf"orch\.toml: {error}"):
            parse_config(OrchestratorConfig, ["@", str(path)])
    task = next(iter(load_env(EnvConfig(id="reverse-text", judge={})).taskset.load()))
    for judge, error in [
        ({"prompt": "{completion} = {answer}?"}, "env.0.judge.answer_field = 'answer': the tasks of 'reverse-text' "
                                                 "have no such field to fill the prompt's {answer}"),
        ({"name": "similarity"}, "env.0.judge.name = 'similarity' is a reward of 'reverse-text' already"),
    ]:  # fmt: skip
        with pytest.raises(TridentError, match=f"^{re.escape(error)}"):
            check_judged(EnvConfig(id="reverse-text", judge=judge), "env.0", task)
    with pytest.raises(TridentError, match=rf"^env\.0\.judge: the tasks of '{ENV_ID}' do not take their taskset's"):
        Orchestrator(OrchestratorConfig(output_dir=tmp_path, env=[{"id": ENV_ID, "judge": {}}]))
    held_out = EvalConfig(env=[{"id": "reverse-text"}, {"id": "reverse-text", "judge": {"name": "similarity"}}])
    with pytest.raises(TridentError, match=r"^eval\.env\.1\.judge\.name = 'similarity' is a reward"):
        load_eval_sets(held_out, TINY_MODEL_ID)
