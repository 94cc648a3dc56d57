"""Several environments in one run: each gives its share of every batch, from its own seeded order."""

import json
import random
from collections import Counter

import pytest

from contracts.errors import TridentError
from orchestrator.config import EnvConfig, OrchestratorConfig, prompts_per_env
from orchestrator.tasks.sampler import StepTasks, TaskOrder
from orchestrator.verifiers_adapter.envs import load_env


@pytest.mark.parametrize(
    ("shares", "batch_size", "expected"),
    [
        ([1.0], 8, [8]),
        ([1.0, 1.0], 8, [4, 4]),
        ([3.0, 1.0], 8, [6, 2]),
        ([1.0, 1.0, 1.0], 8, [3, 3, 2]),  # the leftover prompts go to the first on a tie
        ([0.7, 0.2, 0.1], 10, [7, 2, 1]),
        ([0.5, 0.25, 0.25], 3, [1, 1, 1]),
        ([10.0, 0.1], 8, [8, 0]),
    ],
)
def test_prompts_follow_the_shares_and_fill_the_batch(shares, batch_size, expected):
    assert prompts_per_env(shares, batch_size) == expected


def test_each_step_takes_the_next_tasks_of_every_environment_in_its_share():
    order = TaskOrder([10, 3], counts=[3, 1], seed=0)
    steps = [order.batch(step) for step in range(6)]
    assert all(Counter(e for e, _ in batch) == {0: 3, 1: 1} for batch in steps)
    a_tasks = [task for batch in steps[:3] for e, task in batch if e == 0]
    assert len(set(a_tasks)) == 9 and set(a_tasks) < set(range(10))  # no repeat before the tasks run out
    b_tasks = [task for batch in steps for e, task in batch if e == 1]
    assert b_tasks[:3] == b_tasks[3:] and sorted(b_tasks[:3]) == [0, 1, 2]  # then it wraps around
    again = TaskOrder([10, 3], counts=[3, 1], seed=0)
    assert [again.batch(step) for step in range(6)] == steps  # a pure function of the step: resumes continue it


def test_an_environment_whose_share_rounds_to_no_prompt_is_a_config_error():
    env = [{"id": "reverse-text", "share": 10.0}, {"id": "char-target", "share": 0.1}]
    no_prompt = r"env.1.share = 0.1 gives 'char-target' no prompt of a batch of batch_size = 8"
    with pytest.raises(ValueError, match=no_prompt):
        OrchestratorConfig(env=env, batch_size=8)
    assert OrchestratorConfig(env=env, batch_size=200).env[1].share == 0.1


def test_an_environment_whose_dataset_cannot_be_read_is_one_line_naming_it(tmp_path):
    data = tmp_path / "lite.jsonl"
    data.write_text(json.dumps({"instance_id": "a", "patch": "diff --git a/x.py b/x.py\n"}) + "\n")
    with pytest.raises(TridentError) as error:  # loading reads the first task (does it name an image?)
        load_env(EnvConfig(id="swe-grep-oss-env", args={"dataset": {"path": str(data)}}))
    assert str(error.value) == (
        f"environment 'swe-grep-oss-env': {data}:1: missing field 'problem_statement' "
        "(each row needs instance_id, problem_statement, patch)"
    )
    with pytest.raises(TridentError, match=r"^environment 'swe-grep-oss-env': dataset '.*none\.parquet' not found"):
        load_env(  # loading reads the first task (does it name an image?)
            EnvConfig(id="swe-grep-oss-env", args={"dataset_path": str(tmp_path / "none.parquet")})
        )


def replacements(tasks: StepTasks, attempts: int) -> dict[tuple[int, int], tuple[int, int]]:
    """The replacement of each place and attempt, asked for in a shuffled order (places finish in any order)."""
    asks = [(slot, attempt) for slot in range(len(tasks.tasks)) for attempt in range(1, attempts + 1)]
    random.Random(1).shuffle(asks)
    tried: dict[int, list[int]] = {slot: [task] for slot, (_, task) in enumerate(tasks.tasks)}
    drawn = {}
    for slot, attempt in sorted(asks, key=lambda ask: ask[1]):  # a place's attempts come one after another
        drawn[slot, attempt] = tasks.replacement(slot, attempt, tried[slot])
        tried[slot].append(drawn[slot, attempt][1])
    return drawn


def test_a_steps_replacements_are_different_tasks_none_of_its_own_and_the_same_in_every_run():
    own = [(0, 3), (1, 0), (0, 7), (0, 1), (1, 2)]
    tasks = StepTasks(step=4, seed=0, tasks=own, weights=[[1.0] * 30, [1.0, 2.0, 1.0, 3.0, 1.0, 2.0]])
    drawn = replacements(tasks, attempts=4)
    env_0 = [task for (slot, _), (e, task) in drawn.items() if e == 0]
    assert len(env_0) == 12 and len(set(env_0)) == 12 and not set(env_0) & {3, 7, 1}  # 27 other tasks: enough
    assert all(e == own[slot][0] for (slot, _), (e, _) in drawn.items())  # each from its place's environment
    # environment 1 has 4 other tasks for its 2 places × 4 attempts: those 4 first, then draws that may repeat
    firsts = [drawn[slot, attempt][1] for attempt in (1, 2) for slot in (1, 4)]
    assert sorted(firsts) == [1, 3, 4, 5]
    later = [drawn[slot, attempt][1] for attempt in (3, 4) for slot in (1, 4)]
    assert set(later) <= {1, 3, 4, 5}  # never the step's own while others remain
    again = StepTasks(step=4, seed=0, tasks=own, weights=tasks.weights)
    assert replacements(again, attempts=4) == drawn  # a pure function of seed, step, place and attempt
