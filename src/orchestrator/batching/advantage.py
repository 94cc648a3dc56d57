"""Group-relative advantages: each rollout's reward against the other rollouts of the same prompt (and seat)."""

from collections import Counter

import torch
from jaxtyping import Float
from torch import Tensor

from orchestrator.batching.rollout import Rollout
from orchestrator.config import AdvantageConfig, BaselineGroups


def group_rewards(group: list[Rollout], zero_truncated: bool = False) -> list[float]:
    """The rewards advantages are computed from: each rollout's, or 0 for one cut off by max_tokens under
    ``zero_truncated`` (``zero_truncated_completions``)."""
    return [0.0 if zero_truncated and r.truncated else r.reward for r in group]


def baseline_groups(group: list[Rollout], by: BaselineGroups) -> list[list[int]]:
    """The positions in ``group`` (the rollouts of one task) of the rollouts that share a baseline: the trained
    rollouts of each seat (``"task_seat"``); under ``"episode_seat"`` those of each seat, except that a seat's runs in
    one episode where it played several times share their own (the solvers of one proposed problem); or all trained
    rollouts (``"task"``). An untrained seat's rollouts (``Rollout.trained`` false) share none: they give no sample."""
    plays = Counter((r.episode, r.seat) for r in group)
    shared: dict[tuple, list[int]] = {}
    for i, rollout in enumerate(group):
        if not rollout.trained:
            continue
        key: tuple = () if by == "task" else (rollout.seat,)
        if by == "episode_seat" and plays[rollout.episode, rollout.seat] > 1:
            key += (rollout.episode,)
        shared.setdefault(key, []).append(i)
    return list(shared.values())


def uniform_baselines(group: list[Rollout], rewards: list[float], by: BaselineGroups) -> bool:
    """Whether the rollouts sharing each baseline of ``group`` (:func:`baseline_groups`) all got one reward
    (``rewards``, one per rollout): every advantage of the group is 0, it teaches nothing."""
    return all(len({rewards[i] for i in members}) <= 1 for members in baseline_groups(group, by))


def group_advantages(
    rewards: Float[Tensor, "groups rollouts"], config: AdvantageConfig | None = None
) -> Float[Tensor, "groups rollouts"]:
    """Advantages of rollouts grouped by prompt.

    ``baseline = "mean"``: ``r_i - mean(group)``. ``"leave_one_out"``: ``r_i - mean(group without i)``, which is
    ``n / (n - 1) · (r_i - mean(group))``. ``std_normalize`` then divides by the group's standard deviation
    (unbiased, plus ``1e-6``), as GRPO does; ``mean_normalize`` by the group's mean, as MaxRL does, and a group whose
    mean is 0 or less (no rollout passed) gets 0. A group of one rollout has advantage 0. (``"running"`` is not a
    group baseline: :class:`~orchestrator.batching.running_baseline.RunningBaselines`.)
    """
    config = config or AdvantageConfig()
    n = rewards.shape[1]
    if n == 1:
        return torch.zeros_like(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    advantages = rewards - mean
    if config.baseline == "leave_one_out":
        advantages = advantages * n / (n - 1)
    if config.std_normalize:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + 1e-6)
    if config.mean_normalize:
        passed = mean > 0
        advantages = torch.where(passed, advantages / torch.where(passed, mean, 1.0), 0.0)
    return advantages


def uniform_groups(rewards: list[list[float]]) -> list[bool]:
    """Groups (a row of rewards each) whose rollouts all got the same reward: their advantages are 0, they teach
    nothing."""
    return [len(set(row)) <= 1 for row in rewards]
