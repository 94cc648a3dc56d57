"""The difficulty pool: tasks drawn by their recent pass rate, favouring those neither always nor never solved."""

import json
import random
from collections import Counter

import pytest

from orchestrator.config import OrchestratorConfig
from orchestrator.tasks.difficulty_pool import DifficultyPool, task_weight
from orchestrator.tasks.sampler import TaskSampler, draw


@pytest.mark.parametrize(
    ("pass_rate", "weight"),
    [(None, 1.0), (0.5, 1.0), (0.25, 0.75), (0.9, 0.36), (0.0, 0.05), (1.0, 0.05), (0.99, 0.05)],
)
def test_a_task_weighs_4p_1_minus_p_at_least_min_weight_and_1_unseen(pass_rate, weight):
    assert task_weight(pass_rate, min_weight=0.05) == pytest.approx(weight)  # 4 * 0.99 * 0.01 = 0.0396 < 0.05


def test_draws_are_in_proportion_to_the_weights_and_never_repeat_or_take_an_excluded_task():
    rng = random.Random(0)
    firsts = Counter(draw([1.0, 3.0], 1, rng)[0] for _ in range(8000))
    assert firsts[1] / 8000 == pytest.approx(0.75, abs=0.02)  # 3 / (1 + 3); 4 standard errors ~0.02
    # two of three without replacement: P(first two are {0, 1}) = 1/6 * 2/5 + 2/6 * 1/4 = 0.15 for weights 1, 2, 3
    pairs = Counter(frozenset(draw([1.0, 2.0, 3.0], 2, rng)) for _ in range(8000))
    assert pairs[frozenset({0, 1})] / 8000 == pytest.approx(0.15, abs=0.02)
    assert all(len(set(draw([1.0] * 5, 5, rng))) == 5 for _ in range(20))
    assert all(draw([1.0] * 5, 1, rng, exclude={0, 1, 2, 3}) == [4] for _ in range(20))
    assert len(set(draw([1.0] * 3, 2, rng, exclude={0, 1, 2}))) == 2  # nothing else left: drawn from all
    assert sorted(Counter(draw([1.0] * 3, 7, rng)).values()) == [2, 2, 3]  # more than there are: all, all, one


def test_pass_rates_are_an_ema_of_group_mean_rewards_and_step_n_sees_the_steps_before_n_minus_1():
    pool = DifficultyPool([4], ema=0.5, min_weight=0.05)
    pool.record(0, [(0, 1, 0.5), (0, 2, 1.0), (0, 3, 2.0)])  # 2.0 is clipped to 1
    assert pool.weights(1) == [[1.0] * 4]  # step 1's groups may start before step 0 ends: it sees none of it
    assert pool.weights(2) == [[1.0, 1.0, 0.05, 0.05]]
    pool.record(1, [(0, 1, 0.0), (0, 2, 0.0)])
    pool.record(2, [(0, 1, 0.0)])
    # task 1: 0.5 then 0.0 -> 0.25 (weight 0.75); task 2: 1.0 then 0.0 -> 0.5 (weight 1); step 2 not yet counted
    assert pool.weights(3) == [[1.0, 0.75, 1.0, 0.05]]
    assert pool.pass_rates == [{1: 0.25, 2: 0.5, 3: 1.0}]


def test_the_pool_draws_each_steps_tasks_by_weight_and_its_state_survives_json_exactly():
    pool = DifficultyPool([10, 4], ema=0.3, min_weight=0.05)
    solved = [(0, task, 1.0) for task in range(8)] + [(1, 0, 1.0), (1, 1, 0.0)]  # always or never solved
    pool.record(0, solved)
    pool.record(1, [(0, 8, 0.37), (0, 8, 0.71)])
    pool.record(2, [(1, 2, 0.1)])
    state = json.dumps(pool.state_dict())  # as a checkpoint holds it
    sampler = TaskSampler([10, 4], counts=[2, 1], seed=7, pool=pool)
    batches = [sampler.step_tasks(step).tasks for step in range(3, 300)]
    assert all(Counter(e for e, _ in batch) == {0: 2, 1: 1} for batch in batches)
    assert all(len(set(batch)) == 3 for batch in batches)
    drawn = Counter(task for batch in batches for task in batch)
    # environment 0: task 8's pass rate 0.7 * 0.37 + 0.3 * 0.71 = 0.472 (weight 0.997), task 9 unseen (1), 8 tasks
    # of 0.05 (0.4 together). Expected draws of 8 or 9 in two: 1.997/2.397 (first) + 1.997/2.397 * 1/1.4 + 0.4/2.397
    # * 1.997/2.347 (second) = 1.570; its standard error over 297 steps is ~0.03
    assert (drawn[(0, 8)] + drawn[(0, 9)]) / len(batches) == pytest.approx(1.570, abs=0.1)
    # environment 1: weights 0.05 (always solved), 0.05 (never), 4 * 0.1 * 0.9 = 0.36, 1 (unseen)
    assert drawn[(1, 3)] / len(batches) == pytest.approx(1 / 1.46, abs=0.08)
    assert drawn[(1, 2)] / len(batches) == pytest.approx(0.36 / 1.46, abs=0.08)

    saved = json.loads(json.dumps(DifficultyPool([10, 4], 0.3, 0.05).state_dict()))  # an empty pool's state
    assert saved == {"pass_rates": [{}, {}], "pending": {}}
    restored = DifficultyPool([10, 4], ema=0.3, min_weight=0.05)
    restored.load_state_dict(json.loads(state))
    assert json.dumps(restored.state_dict()) == state
    again = TaskSampler([10, 4], counts=[2, 1], seed=7, pool=restored)
    assert [again.step_tasks(step).tasks for step in range(3, 300)] == batches


def test_difficulty_pool_and_filter_config_are_validated_in_one_line():
    config = OrchestratorConfig(difficulty_pool={}, filter={"refill": True})
    assert config.difficulty_pool.ema == 0.5 and config.filter.max_attempts == 4
    assert OrchestratorConfig().difficulty_pool is None and not OrchestratorConfig().filter.refill
    with pytest.raises(ValueError, match="filter.max_attempts\n  Input should be greater than or equal to 1"):
        OrchestratorConfig(filter={"refill": True, "max_attempts": 0})
    with pytest.raises(ValueError, match="difficulty_pool.min_weight\n  Input should be greater than 0"):
        OrchestratorConfig(difficulty_pool={"min_weight": 0})
