import torch
from rollouts import rollout

from orchestrator.batching.advantage import (
    baseline_groups,
    group_advantages,
    group_rewards,
    uniform_baselines,
    uniform_groups,
)
from orchestrator.config import AdvantageConfig


def test_group_advantages_subtract_group_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]])
    advantages = group_advantages(rewards)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(advantages.sum(dim=1), torch.zeros(2))


def test_leave_one_out_and_std_normalization():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    loo = group_advantages(rewards, AdvantageConfig(baseline="leave_one_out"))
    # rollout 0: 1 - mean(0, 0, 1) = 2/3
    torch.testing.assert_close(loo[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    normalized = group_advantages(rewards, AdvantageConfig(std_normalize=True))
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as GRPO
    torch.testing.assert_close(normalized[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    torch.testing.assert_close(normalized[1], torch.zeros(4))  # a tied group stays 0, not NaN
    assert uniform_groups(rewards.tolist()) == [False, True]
    assert uniform_groups([[1.0, 1.0], [0.0, 0.5, 0.0]]) == [True, False]  # groups of different sizes
    assert group_advantages(torch.tensor([[1.0], [2.0]])).tolist() == [[0.0], [0.0]]  # nothing to compare with


def test_groups_of_one_or_two_rollouts():
    pair = torch.tensor([[1.0, 0.0]])
    torch.testing.assert_close(group_advantages(pair), torch.tensor([[0.5, -0.5]]))
    for config in (AdvantageConfig(baseline="leave_one_out"), AdvantageConfig(std_normalize=True)):
        assert group_advantages(torch.tensor([[1.0]]), config).tolist() == [[0.0]]  # not 0 / 0


def test_the_std_floor_is_added_not_subtracted():
    # std of (0, 2e-6) is sqrt(2) * 1e-6; the advantages are +-1e-6 / (std + 1e-6)
    advantages = group_advantages(torch.tensor([[0.0, 2e-6]], dtype=torch.float64), AdvantageConfig(std_normalize=True))
    expected = 1e-6 / (2**0.5 * 1e-6 + 1e-6)
    torch.testing.assert_close(advantages, torch.tensor([[-expected, expected]], dtype=torch.float64))


def test_truncated_rollouts_score_zero_only_when_asked():
    group = [rollout(1.0), rollout(0.5, truncated=True)]
    assert group_rewards(group) == [1.0, 0.5]
    assert group_rewards(group, zero_truncated=True) == [1.0, 0.0]


# a proposer plays once in each of two episodes, a solver twice in the first and once in the second; an untrained
# judge plays in the first
SEATS = [("proposer", 1, True), ("solver", 1, True), ("solver", 1, True), ("judge", 1, False)]
SEATS += [("proposer", 2, True), ("solver", 2, True)]
PLAYS = [rollout(0.0, seat=seat, episode=episode, trained=trained) for seat, episode, trained in SEATS]


def test_baselines_are_shared_by_seat_by_seat_and_episode_or_by_task():
    assert baseline_groups(PLAYS, "task_seat") == [[0, 4], [1, 2, 5]]
    assert baseline_groups(PLAYS, "episode_seat") == [[0, 4], [1, 2], [5]]
    assert baseline_groups(PLAYS, "task") == [[0, 1, 2, 4, 5]]
    two_seats_twice = [rollout(0.0, seat=seat, episode=1) for seat in ("a", "a", "b", "b")]
    assert baseline_groups(two_seats_twice, "episode_seat") == [[0, 1], [2, 3]]  # one episode, still by seat


def test_a_group_is_uniform_when_the_rollouts_of_each_baseline_tied():
    rewards = [1.0, 0.0, 0.0, 5.0, 1.0, 0.0]  # each seat tied; the judge's 5 shares no baseline
    assert uniform_baselines(PLAYS, rewards, "task_seat") and uniform_baselines(PLAYS, rewards, "episode_seat")
    assert not uniform_baselines(PLAYS, rewards, "task")
    solved_once = [1.0, 1.0, 0.0, 5.0, 1.0, 0.0]
    assert not uniform_baselines(PLAYS, solved_once, "task_seat")
    assert not uniform_baselines(PLAYS, solved_once, "episode_seat")  # the first episode's solvers did not tie
    assert uniform_baselines(PLAYS, [1.0, 1.0, 1.0, 1.0, 1.0, 0.0], "episode_seat")  # episode 2's lone solver
