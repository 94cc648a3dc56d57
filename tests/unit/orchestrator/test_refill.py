"""[filter] refill: groups whose rollouts all got the same reward are replaced by groups of new tasks until the
batch is full of groups that teach something, or a place's attempts run out (counted)."""

import asyncio
import json
from dataclasses import replace

import httpx
import pytest
from resumed_runs import batch_tasks
from rollouts import TWO_SAMPLED, group, rollout

import orchestrator.loop.groups as groups_module
from contracts.metrics import read_metrics
from orchestrator.config import OrchestratorConfig

TASKS = 40


def index(task) -> int:
    return int(task.data.id.removeprefix("char-target-"))


def fake_groups(monkeypatch, rewards_of) -> list[int]:
    """Every group's rollouts score ``rewards_of(task index)``, each with a branch of its own (a teacher's scores and
    weights are set on it); returns the task of each group run, in order."""
    sampled = []

    async def run_group(env, task, n, ctx, limits, output_dir):
        sampled.append(index(task))
        return [rollout(reward, replace(TWO_SAMPLED), env="char-target", task=task.data.id)
                for reward in rewards_of(index(task))]  # fmt: skip

    monkeypatch.setattr(groups_module, "run_group", run_group)
    return sampled


def config(tmp_path, **settings) -> OrchestratorConfig:
    return OrchestratorConfig(output_dir=tmp_path, env=[{"id": "char-target", "args": {"num_examples": TASKS}}],
                              batch_size=4, rollouts_per_example=2, max_steps=2, sample_rollouts_every=0,
                              **settings)  # fmt: skip


def test_groups_with_no_reward_variance_are_replaced_until_the_batch_is_full(tmp_path, monkeypatch, on_weights_server):
    # only tasks divisible by 5 split their group (rewards 0 and 1); the others score 1 in both rollouts
    sampled = fake_groups(monkeypatch, lambda task: [0.0, 1.0] if task % 5 == 0 else [1.0, 1.0])
    orchestrator, _ = on_weights_server(config(tmp_path, filter={"refill": True, "max_attempts": 40}))
    first = [index(task) for _, task in orchestrator.batch_tasks(1)]
    asyncio.run(orchestrator.step(1))

    assert sampled[:4] == first  # the step's own tasks first, then the replacements
    kept = [task for task in sampled if task % 5 == 0]
    assert len(kept) == 4  # every place ends with a group that splits ...
    assert sorted(batch_tasks(tmp_path, 1)) == sorted(f"char-target-{task}" for task in kept for _ in range(2))
    assert not set(sampled[4:]) & set(first)  # ... and no replacement repeats a task of the step
    [metrics] = read_metrics(tmp_path, "orchestrator")
    replaced = len(sampled) - 4
    assert metrics["refill/groups"] == metrics["refill/dropped_groups"] == replaced > 0
    assert metrics["refill/unfilled"] == 0 and metrics["uniform_groups"] == 0
    assert metrics["refill/attempts_mean"] == len(sampled) / 4
    # the first groups' reward is the batch as drawn, before refills: 1 for a uniform group, 0.5 for a split one
    first_rewards = [0.5 if task % 5 == 0 else 1.0 for task in first]
    assert metrics["refill/first_reward_mean"] == pytest.approx(sum(first_rewards) / 4)
    assert metrics["reward_mean"] == 0.5 and metrics["samples"] == 8


def test_attempts_are_bounded_and_what_they_could_not_fill_is_counted_and_left_out(
    tmp_path, monkeypatch, on_weights_server
):
    splits = {0}  # only task 0's group splits
    sampled = fake_groups(monkeypatch, lambda task: [0.0, 1.0] if task in splits else [0.0, 0.0])
    orchestrator, _ = on_weights_server(config(tmp_path, filter={"refill": True, "max_attempts": 3}))
    monkeypatch.setattr(orchestrator.tasks.order, "batch", lambda step: [(0, 0), (0, 1), (0, 2), (0, 3)])
    asyncio.run(orchestrator.step(1))

    assert len(sampled) == 1 + 3 * 3  # task 0's place: one group; the three others: three each, then they stop
    assert batch_tasks(tmp_path, 1) == ["char-target-0"] * 2  # the places left unfilled are not trained
    [metrics] = read_metrics(tmp_path, "orchestrator")
    assert metrics["refill/groups"] == 6 and metrics["refill/unfilled"] == 3
    assert metrics["refill/dropped_groups"] == 9 and metrics["refill/attempts_max"] == 3

    sampled.clear()  # every group of a step ties, attempts run out: the step still writes its batch (trains nothing)
    splits.clear()
    asyncio.run(orchestrator.step(2))
    assert len(sampled) == 12 and len(batch_tasks(tmp_path, 2)) == 8
    assert read_metrics(tmp_path, "orchestrator")[1]["refill/unfilled"] == 4


def test_without_refill_a_tied_group_stays_and_nothing_is_refilled(tmp_path, monkeypatch, on_weights_server):
    sampled = fake_groups(monkeypatch, lambda task: [0.0, 1.0] if task % 2 else [1.0, 1.0])
    orchestrator, _ = on_weights_server(config(tmp_path))
    asyncio.run(orchestrator.step(1))
    assert len(sampled) == 4 and len(batch_tasks(tmp_path, 1)) == 8
    assert not any(key.startswith("refill/") for key in read_metrics(tmp_path, "orchestrator")[0])


def test_a_steps_groups_are_of_different_tasks_the_same_in_every_run(tmp_path, monkeypatch, on_weights_server):
    """Replacement tasks are a pure function of the seed, step, place and attempt: a resumed run redraws them. Places
    refilled in the same step draw different tasks (test_tasks.py: an environment with too few)."""
    runs = []
    for run in ("first", "second"):
        sampled = fake_groups(monkeypatch, lambda task: [0.0, 1.0] if task % 11 == 0 else [0.0, 0.0])
        orchestrator, _ = on_weights_server(config(tmp_path / run, filter={"refill": True, "max_attempts": 8}))
        asyncio.run(orchestrator.step(1))
        runs.append(sorted(sampled))  # places run concurrently: compare as sets of draws
    assert runs[0] == runs[1] and len(runs[0]) > 4
    assert len(set(runs[0])) == len(runs[0])  # no task sampled twice in the step


def test_a_group_whose_every_seat_tied_is_replaced_unless_the_task_is_one_baseline(
    tmp_path, monkeypatch, on_weights_server
):
    # a two-seat game: in tasks divisible by 5 the players trade wins; in the others player a always wins
    sampled = []

    async def run_group(env, task, n, ctx, limits, output_dir):
        sampled.append(index(task))
        wins = [1.0, 0.0] if index(task) % 5 == 0 else [1.0, 1.0]
        return [rollout for win in wins for rollout in (
            group([win], TWO_SAMPLED, env="char-target", task=task.data.id, seat="a")
            + group([1.0 - win], TWO_SAMPLED, env="char-target", task=task.data.id, seat="b"))]  # fmt: skip

    monkeypatch.setattr(groups_module, "run_group", run_group)
    orchestrator, _ = on_weights_server(config(tmp_path, filter={"refill": True, "max_attempts": 40}))
    asyncio.run(orchestrator.step(1))
    assert len(sampled) > 4 and {int(task.removeprefix("char-target-")) % 5 for task in batch_tasks(tmp_path, 1)} == {0}
    sampled.clear()
    one_baseline = config(tmp_path / "task", filter={"refill": True}, advantage={"baseline_groups": "task"})
    orchestrator, _ = on_weights_server(one_baseline)
    asyncio.run(orchestrator.step(1))
    assert len(sampled) == 4  # a's 1s and b's 0s share one baseline: every group varies, none is replaced


def prompt_logprobs(request: httpx.Request) -> httpx.Response:
    """A teacher's ``/v1/completions`` answer: each prompt token after the first at logprob -0.5."""
    prompt = json.loads(request.content)["prompt"]
    entries = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in prompt[1:]]
    return httpx.Response(200, json={"choices": [{"index": 0, "text": "z", "prompt_logprobs": entries}]})


@pytest.mark.parametrize("algorithm", ["opd", "opsd", "sft"])
def test_a_tied_group_of_a_distilled_or_taught_env_is_kept_not_replaced(tmp_path, monkeypatch, on_weights_server,
                                                                        algorithm):  # fmt: skip
    """A distilled group (opd, opsd) trains on the teacher's per-token signal and an sft one on the teacher's tokens,
    whatever the rewards: refill replaces none of their tied groups, and the batch keeps them all."""
    sampled = fake_groups(monkeypatch, lambda task: [1.0, 1.0])
    settings = {"opd": {"teacher": {"base_url": "http://teacher:8001", "model": "big"}},
                "opsd": {"self_distill": {"demonstration_key": "id"}},
                "sft": {"teacher": {"base_url": "http://teacher:8001", "model": "big"}}}[algorithm]  # fmt: skip
    refill = {"refill": True, "max_attempts": 40}
    orchestrator, _ = on_weights_server(config(tmp_path, algorithm=algorithm, filter=refill, **settings))
    for teacher in (orchestrator.teacher, orchestrator.self_teacher):
        if teacher is not None:
            teacher.http = httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(prompt_logprobs))
    asyncio.run(orchestrator.step(1))
    assert len(sampled) == 4 and len(batch_tasks(tmp_path, 1)) == 8
    [metrics] = read_metrics(tmp_path, "orchestrator")
    assert metrics["refill/groups"] == metrics["refill/dropped_groups"] == metrics["refill/unfilled"] == 0
