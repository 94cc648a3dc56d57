"""Held-out evaluation (``[eval]``): the served weights' scores on held-out tasks, k rollouts each.

:class:`Evaluation` needs only the servers to sample from (a :class:`~orchestrator.loop.groups.GroupRunner`) and where
to log: ``eval`` runs one alone (:mod:`orchestrator.eval_main`). During training the orchestrator starts one beside the
step's groups whenever the served weights reach the next ``interval`` (its rollouts queue behind the step's for
``max_concurrent``'s slots) and holds the next weight reload until it is done, so every rollout of an evaluation
samples from the weights it is logged under.
"""

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass

from contracts.metrics import MetricsWriter, eval_line
from contracts.progress import Progress
from orchestrator.batching.rollout import Rollout
from orchestrator.config import EvalConfig
from orchestrator.loop.groups import GroupRunner, track
from orchestrator.metrics.failed_rollouts import write_failed_rollouts
from orchestrator.verifiers_adapter.envs import Env, load_env, load_tasks
from orchestrator.verifiers_adapter.judge import check_judged
from orchestrator.verifiers_adapter.prompt_images import check_model_sees_images

logger = logging.getLogger("orchestrator")


@dataclass
class EvalSet:
    """One held-out environment and its tasks."""

    name: str  # its metrics are eval/<name>/<metric>
    env: Env
    tasks: list


def load_eval_sets(config: EvalConfig, model: str) -> list[EvalSet]:
    """Each ``[[eval.env]]`` with its first ``num_examples`` tasks, named by its id (``<id>.<i>`` for an id that
    more than one table uses); refused at once (a TridentError) where its first task needs a judge it lacks or shows
    images to ``model``, a text model."""
    ids = [env.id for env in config.env]
    sets = []
    for i, env_config in enumerate(config.env):
        env = load_env(env_config)
        tasks = load_tasks(env, config.num_examples)
        if tasks:
            check_judged(env_config, f"eval.env.{i}", tasks[0])
            check_model_sees_images(env_config.id, f"eval.env.{i}", tasks[0], model)
        name = env_config.id if ids.count(env_config.id) == 1 else f"{env_config.id}.{i}"
        sets.append(EvalSet(name, env, tasks))
    return sets


def eval_scores(name: str, groups: list[list[Rollout]], pass_reward: float) -> dict[str, float]:
    """``eval/<name>/...`` of one environment's groups (one per task, k rollouts each): ``reward_mean`` over all
    rollouts, ``pass@k`` (share of tasks with a rollout whose reward is at least ``pass_reward``), ``avg@k`` (share of
    passing rollouts, averaged over tasks) and ``failed`` rollouts. A failed rollout scores 0 and does not pass.
    When the groups hold several seats, each seat's too, as ``eval/<name>/<seat>/...`` over its own rollouts (its k
    those of a task: ``n × rollouts_per_example`` for a seat that plays n times an episode)."""
    scores = _scores(f"eval/{name}", groups, pass_reward)
    seats = dict.fromkeys(r.seat for group in groups for r in group)
    for seat in seats if len(seats) > 1 else ():
        scores |= _scores(
            f"eval/{name}/{seat}", [[r for r in group if r.seat == seat] for group in groups], pass_reward
        )
    return scores


def _scores(prefix: str, groups: list[list[Rollout]], pass_reward: float) -> dict[str, float]:
    k = len(groups[0])
    passed = [[r.ok and r.reward >= pass_reward for r in group] for group in groups]
    return {
        f"{prefix}/reward_mean": statistics.fmean(r.reward if r.ok else 0.0 for group in groups for r in group),
        f"{prefix}/pass@{k}": statistics.fmean(any(group) for group in passed),
        f"{prefix}/avg@{k}": statistics.fmean(statistics.fmean(group) for group in passed),
        f"{prefix}/failed": sum(not r.ok for group in groups for r in group),
    }


class Evaluation:
    """Evaluations of the served weights (of ``model``) on ``config``'s held-out sets (none without ``config``),
    sampled with ``groups``; their records go to ``metrics`` (``metrics/eval.jsonl``), what runs to ``progress``."""

    def __init__(
        self, config: EvalConfig | None, model: str, groups: GroupRunner, metrics: MetricsWriter, progress: Progress
    ):
        self.config = config
        self.sets = load_eval_sets(config, model) if config else []
        self.groups, self.metrics, self.progress = groups, metrics, progress
        self.running: tuple[int, asyncio.Task] | None = None  # the weights step in evaluation, and its evaluation
        self.next_due = 0  # the weights step from which the next evaluation is due

    async def evaluate(self, weight_step: int) -> dict:
        """Score the served weights (``weight_step``) on every held-out task, k rollouts each; log the scores and
        return their record. Its failed rollouts go to ``metrics/failed_rollouts.jsonl``, marked as an evaluation's."""
        start = time.perf_counter()
        k = self.config.rollouts_per_example
        runs = [[asyncio.ensure_future(self.groups.run(s.env, task, k)) for task in s.tasks] for s in self.sets]
        track(self.progress, f"evaluating weights step {weight_step}", [run for set_runs in runs for run in set_runs])
        groups = await asyncio.gather(*(asyncio.gather(*set_runs) for set_runs in runs))
        every_group = [group for set_groups in groups for group in set_groups]
        write_failed_rollouts(self.metrics.output_dir, weight_step, every_group, evaluation=True)
        scores = {}
        for eval_set, set_groups in zip(self.sets, groups, strict=True):
            scores |= eval_scores(eval_set.name, set_groups, self.config.pass_reward)
        record = {"step": weight_step, **scores, "eval/seconds": time.perf_counter() - start}
        self.metrics.write_eval(record)
        logger.info(eval_line(record))
        return record

    def start_if_due(self, served_step: int) -> None:
        """Evaluate the served weights (``served_step``) in the background once they reach the next multiple of
        ``interval`` (step 0 first), unless an evaluation runs."""
        if not self.sets or self.running is not None or served_step < self.next_due:
            return
        interval = self.config.interval
        self.next_due = (served_step // interval + 1) * interval
        self.running = served_step, asyncio.create_task(self.evaluate(served_step))

    async def finish(self) -> None:
        """Wait for the evaluation in flight, if any."""
        running, self.running = self.running, None
        if running is not None:
            step, evaluation = running
            with self.progress.doing(f"waiting for the evaluation of weights step {step} to end"):
                await evaluation

    def cancel(self) -> None:
        """Stop the evaluation in flight, if any (the run stops)."""
        if self.running is not None:
            self.running[1].cancel()
