"""Several environments in one run: each gives its share of every batch, from its own seeded order."""

import json
from collections import Counter

import pytest

from contracts.errors import TridentError
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.tasks import TaskOrder, prompts_per_env
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
