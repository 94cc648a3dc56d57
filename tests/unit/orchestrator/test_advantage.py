import torch

from orchestrator.advantage import group_advantages


def test_group_advantages_subtract_group_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]])
    advantages = group_advantages(rewards)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(advantages.sum(dim=1), torch.zeros(2))
