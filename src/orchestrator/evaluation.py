"""Held-out evaluation during training (``[eval]``): the served weights' scores on held-out tasks, k rollouts each.

The orchestrator runs an evaluation on the run's servers beside training (its rollouts queue behind the step's for
``max_concurrent``'s slots) and holds the next weight reload until it is done, so every rollout of an evaluation
samples from the weights it is logged under.
"""

import statistics
from dataclasses import dataclass

import verifiers.v1 as vf

from orchestrator.config import EvalConfig
from orchestrator.envs import Rollout, load_env, load_tasks
from orchestrator.judge import check_judged


@dataclass
class EvalSet:
    """One held-out environment and its tasks."""

    name: str  # its metrics are eval/<name>/<metric>
    env: vf.Env
    tasks: list


def load_eval_sets(config: EvalConfig) -> list[EvalSet]:
    """Each ``[[eval.env]]`` with its first ``num_examples`` tasks, named by its id (``<id>.<i>`` for an id that
    more than one table uses)."""
    ids = [env.id for env in config.env]
    sets = []
    for i, env_config in enumerate(config.env):
        env = load_env(env_config)
        tasks = load_tasks(env, config.num_examples)
        if tasks:
            check_judged(env_config, f"eval.env.{i}", tasks[0])
        name = env_config.id if ids.count(env_config.id) == 1 else f"{env_config.id}.{i}"
        sets.append(EvalSet(name, env, tasks))
    return sets


def eval_scores(name: str, groups: list[list[Rollout]], pass_reward: float) -> dict[str, float]:
    """``eval/<name>/...`` of one environment's groups (one per task, k rollouts each): ``reward_mean`` over all
    rollouts, ``pass@k`` (share of tasks with a rollout whose reward is at least ``pass_reward``), ``avg@k`` (share of
    passing rollouts, averaged over tasks) and ``failed`` rollouts. A failed rollout scores 0 and does not pass."""
    k = len(groups[0])
    passed = [[r.ok and r.reward >= pass_reward for r in group] for group in groups]
    return {
        f"eval/{name}/reward_mean": statistics.fmean(r.reward if r.ok else 0.0 for group in groups for r in group),
        f"eval/{name}/pass@{k}": statistics.fmean(any(group) for group in passed),
        f"eval/{name}/avg@{k}": statistics.fmean(statistics.fmean(group) for group in passed),
        f"eval/{name}/failed": sum(not r.ok for group in groups for r in group),
    }
