import pytest
import torch
from rollouts import ONE_SAMPLED, build_samples, rollout

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


def test_mean_normalize_divides_the_centred_reward_by_the_group_mean_as_maxrl():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    maxrl = group_advantages(rewards, AdvantageConfig(mean_normalize=True))
    # pass rate 1/4: (1 - 1/4) / (1/4) = 3 for the pass, (0 - 1/4) / (1/4) = -1 for each fail; pass rate 1/2: +-1;
    # no pass (mean 0): 0, not 0 / 0; all pass: 0
    expected = [[3.0, -1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0], [0.0] * 4, [0.0] * 4]
    torch.testing.assert_close(maxrl, torch.tensor(expected))
    loo = group_advantages(rewards[:1], AdvantageConfig(baseline="leave_one_out", mean_normalize=True))
    torch.testing.assert_close(loo, torch.tensor([[4.0, -4 / 3, -4 / 3, -4 / 3]]))  # 4/3 of the above
    # rewards outside [0, 1]: a group whose mean is 0 or less gets 0; otherwise the same division
    outside = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0], [3.0, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(
        group_advantages(outside, AdvantageConfig(mean_normalize=True)),
        torch.tensor([[0.0] * 4, [3.0, -1.0, -1.0, -1.0], [5.0, -3.0, -1.0, -1.0]]),
    )
    assert group_advantages(torch.tensor([[1.0]]), AdvantageConfig(mean_normalize=True)).tolist() == [[0.0]]


def test_mean_and_std_normalize_are_refused_together():
    with pytest.raises(ValueError, match="mean_normalize and std_normalize are both set"):
        AdvantageConfig(mean_normalize=True, std_normalize=True)


def test_episode_seat_gives_the_solvers_of_each_problem_and_the_proposers_of_the_task_their_own_baselines():
    """Hierarchical baselines for a proposer and its solvers: two episodes, each a proposal and two solver runs."""
    seats = [("proposer", 0), ("solver", 0), ("solver", 0), ("proposer", 1), ("solver", 1), ("solver", 1)]
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    group = [rollout(r, ONE_SAMPLED, seat=seat, episode=e) for r, (seat, e) in zip(rewards, seats, strict=True)]
    advantages = build_samples([group], 0, advantage=AdvantageConfig(baseline_groups="episode_seat"))[2]
    # proposers against the task's proposers' mean 1/2; episode 0's solvers against their mean 1/2, episode 1's
    # against theirs (1: tied, 0)
    assert advantages == [[0.5, 0.5, -0.5, -0.5, 0.0, 0.0]]
    # the MaxRL division per baseline: the proposers' (1 - 1/2) / (1/2) = 1; episode 1's solvers still 0
    maxrl = AdvantageConfig(baseline_groups="episode_seat", mean_normalize=True)
    assert build_samples([group], 0, advantage=maxrl)[2] == [[1.0, 1.0, -1.0, -1.0, 0.0, 0.0]]
    # under task_seat the four solver runs share one baseline, 3/4, across both problems
    assert build_samples([group], 0)[2] == [[0.5, 0.25, -0.75, -0.5, 0.25, 0.25]]
