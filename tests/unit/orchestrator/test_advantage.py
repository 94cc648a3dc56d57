import torch

from orchestrator.batching.advantage import group_advantages, uniform_groups
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
