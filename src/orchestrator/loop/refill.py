"""Dynamic sampling (``[filter] refill``): a group whose rollouts all got the same reward has advantage 0 and, on
``grpo``, teaches nothing, so it is replaced by a group of a new task until one has reward variance or
``max_attempts`` run out. Each of a step's ``batch_size`` places of the batch is filled this way on its own, as its
groups finish. A group of another algorithm is never replaced: a distilled one trains on the teacher's per-token
signal, an ``sft`` or ``echo`` one on its cross-entropy weights, whatever the rewards."""

import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from orchestrator.batching.advantage import group_rewards, uniform_baselines
from orchestrator.batching.infra import is_lost
from orchestrator.batching.rollout import Rollout
from orchestrator.config import REWARD_ONLY, BaselineGroups, FilterConfig
from orchestrator.tasks.sampler import StepTasks


@dataclass
class Slot:
    """One place of a step's batch: the groups sampled for it in order, ``(environment, task, rollouts)`` each;
    the last is the one that goes to the batch."""

    tries: list[tuple[int, int, list[Rollout]]]

    @property
    def group(self) -> list[Rollout]:
        return self.tries[-1][2]


def no_variance(group: list[Rollout], zero_truncated: bool, by: BaselineGroups) -> bool:
    """Whether the rollouts sharing each baseline of the group (``advantage.baseline_groups``: by default each seat's)
    all got the same reward (as advantages see it), so it teaches nothing."""
    return uniform_baselines(group, group_rewards(group, zero_truncated), by)


def needs_refill(group: list[Rollout], zero_truncated: bool, by: BaselineGroups) -> bool:
    """A group trained on its rewards alone (:data:`~orchestrator.config.REWARD_ONLY`) with no reward variance that
    was not lost to infrastructure errors (those are counted apart)."""
    reward_only = all(r.algorithm in REWARD_ONLY for r in group)
    return reward_only and not is_lost(group) and no_variance(group, zero_truncated, by)


async def fill_slot(
    run: Callable[[int, int], Awaitable[list[Rollout]]],
    tasks: StepTasks,
    slot: int,
    config: FilterConfig,
    zero_truncated: bool,
    by: BaselineGroups,
) -> Slot:
    """Sample place ``slot`` of the step's batch: ``run(environment, task)`` its task's group and, with
    ``config.refill``, a replacement task's (:meth:`StepTasks.replacement`) while the group has no reward variance,
    up to ``config.max_attempts`` groups (the variance within each baseline, as ``by`` groups them). A group lost to
    infrastructure errors is not replaced."""
    env, task = tasks.tasks[slot]
    tries = []
    while True:
        group = await run(env, task)
        tries.append((env, task, group))
        if not (config.refill and len(tries) < config.max_attempts and needs_refill(group, zero_truncated, by)):
            return Slot(tries)
        env, task = tasks.replacement(slot, len(tries), [tried for _, tried, _ in tries])


def pool_results(slots: list[Slot], zero_truncated: bool) -> list[tuple[int, int, float]]:
    """``(environment, task, mean reward of its finished rollouts)`` of every group the slots sampled, in order,
    lost groups and groups with no finished rollout left out: what the difficulty pool learns from."""
    results = []
    for slot in slots:
        for env, task, group in slot.tries:
            scored = zip(group_rewards(group, zero_truncated), group, strict=True)
            rewards = [reward for reward, rollout in scored if rollout.ok]
            if rewards and not is_lost(group):
                results.append((env, task, statistics.fmean(rewards)))
    return results


def refill_metrics(slots: list[Slot], zero_truncated: bool, by: BaselineGroups) -> dict[str, float]:
    """What refilling did in one step (see docs/metrics.md)."""
    attempts = [len(slot.tries) for slot in slots]
    first = [reward for slot in slots for reward in group_rewards(slot.tries[0][2], zero_truncated)]
    return {
        "refill/groups": sum(attempts) - len(slots),
        "refill/dropped_groups": sum(
            needs_refill(group, zero_truncated, by) for slot in slots for *_, group in slot.tries
        ),
        "refill/unfilled": sum(needs_refill(slot.group, zero_truncated, by) for slot in slots),
        "refill/attempts_mean": statistics.fmean(attempts),
        "refill/attempts_max": max(attempts),
        "refill/first_reward_mean": statistics.fmean(first),
    }
