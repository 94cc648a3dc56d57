"""Groups of rollouts on the run's inference servers: what training steps and evaluations both sample with.

A group runs on the least loaded server that is up (:meth:`Servers.lease`) and runs again on another when its
server is set aside before it ends, or fails rollouts and then does not answer. A group whose rollout worker dies
runs again on a new one, up to ``infra.max_retries`` times, and is then lost as rollouts that keep failing with
infrastructure errors are.
"""

import asyncio
import logging
import os
from collections.abc import Awaitable
from pathlib import Path

from contracts.model_card import ModelCard
from contracts.progress import Progress
from orchestrator.batching.rollout import Rollout
from orchestrator.config import Algorithm, EvalRunConfig, InfraConfig, OrchestratorConfig
from orchestrator.loop.workers import RolloutWorkers, WorkerLost, cpu_seconds
from orchestrator.serving.servers import Server, ServerDown, Servers
from orchestrator.verifiers_adapter.envs import (
    NO_API_KEY_VAR,
    ModelContext,
    at_server,
    env_config,
    model_context,
    run_group,
    seats,
    task_id,
)
from orchestrator.verifiers_adapter.limits import RolloutLimits, run_limits
from orchestrator.verifiers_adapter.renderer import check_renderer

logger = logging.getLogger("orchestrator")


class GroupRunner:
    """Runs groups of ``group_size`` rollouts (unless told otherwise) on ``servers``, sampling as ``ctx`` says, within
    ``limits``: in this process, or on rollout ``workers`` (each within its share of the limits). The images the
    rollouts show are stored in the run at ``output_dir``. ``teacher`` (a context sampling from the teacher's server,
    with the teacher's key) samples the groups of ``sft`` (distillation from the teacher's samples) instead."""

    def __init__(self, servers: Servers, ctx: ModelContext, limits: RolloutLimits, group_size: int,
                 workers: RolloutWorkers | None = None, output_dir: Path | None = None,
                 teacher: ModelContext | None = None):  # fmt: skip
        self.servers = servers
        self.ctx = ctx
        self.teacher = teacher
        self.limits = limits
        self.group_size = group_size
        self.workers = workers
        self.output_dir = output_dir

    async def run(self, env, task, n: int | None = None, per_server: list[int] | None = None,
                  algorithm: Algorithm = "grpo") -> list[Rollout]:  # fmt: skip
        """One group of ``n`` rollouts of ``task`` (default ``group_size``), on the least loaded server; run again
        on another if that server is set aside before the group ends, or fails rollouts and then does not answer;
        run again if its rollout worker dies, up to ``infra.max_retries`` times, then lost. Its rollouts are
        labelled with ``algorithm``, their environment's (an evaluation's: the default, sampled by the policy).
        ``per_server`` counts the rollouts each server finished (by its place in ``client.base_url``)."""
        rollouts = await self._run(env, task, n or self.group_size, per_server, algorithm)
        for rollout in rollouts:
            rollout.algorithm = algorithm
        return rollouts

    async def _run(self, env, task, n: int, per_server: list[int] | None, algorithm: Algorithm) -> list[Rollout]:
        workers_lost = 0
        while True:
            async with self.servers.lease() as server:
                try:
                    rollouts = await self.servers.guard(server, self.group(env, task, n, server, algorithm))
                except ServerDown:
                    rollouts = None
                except WorkerLost as e:  # the pool said so, and starts another worker
                    if workers_lost == self.limits.max_retries:
                        return self.lost_to_workers(env, task, n, e)
                    workers_lost += 1
                    continue
                if rollouts is not None and (all(r.ok for r in rollouts) or await self.servers.answers(server)):
                    if per_server is not None:
                        per_server[self.servers.servers.index(server)] += n
                    return rollouts
            logger.warning(f"a group of task {task_id(task.data)} runs again on another server")

    def lost_to_workers(self, env, task, n: int, error: WorkerLost) -> list[Rollout]:
        """The rollouts of a group of ``n`` episodes (one per seat of each) lost because its rollout worker died at
        each of its tries (one line says
        so), as a group lost to infrastructure errors is (:func:`~orchestrator.batching.infra.is_lost`)."""
        env_id, retries = env_config(env).id, self.limits.max_retries
        logger.warning(
            f"a group of task {task_id(task.data)} in environment {env_id!r} is lost: its rollout worker died at each "
            f"of its {retries + 1} tries (infra.max_retries = {retries}), last: {error}"
        )
        error_text = f"WorkerLost: {error}"
        return [Rollout(reward=0.0, branches=[], ok=False, error=error_text, task=task_id(task.data), env=env_id,
                        lost=True, retries=retries, seat=seat) for _ in range(n) for seat in seats(env)]  # fmt: skip

    def group(self, env, task, n: int, server: Server, algorithm: Algorithm) -> Awaitable[list[Rollout]]:
        """The rollouts of one group on ``server`` (on the teacher's, with its key, for ``sft``), run here or by a
        worker."""
        ctx = self.teacher if algorithm == "sft" and self.teacher is not None else self.context(server)
        if self.workers is None:
            return run_group(env, task, n, ctx, self.limits, self.output_dir)
        client = ctx.client
        return self.workers.run_group(env_config(env), task, n, client.base_url, ctx.model, client.api_key_var)

    def context(self, server: Server) -> ModelContext:
        """The model context that samples from ``server`` (under the name it serves the policy as)."""
        return at_server(self.ctx, f"{server.url}/v1", server.client.model)

    def rollout_cpu(self) -> dict[int, float]:
        """CPU seconds used so far by each process that runs rollouts (this one, or the workers), by pid."""
        pids = self.workers.pids if self.workers is not None else [os.getpid()]
        return {pid: cpu_seconds(pid) for pid in pids}

    async def close(self) -> None:
        """Stop the rollout workers, if any."""
        if self.workers is not None:
            await self.workers.close()


def connect(config: OrchestratorConfig | EvalRunConfig, infra: InfraConfig, group_size: int) -> GroupRunner:
    """A :class:`GroupRunner` on the servers of ``config.client`` (not yet asked anything), sampling as
    ``config.sampling`` says through the model's renderer, checked against its chat template first."""
    model_path = ModelCard.of(config.model.name).path
    ctx = model_context(config, model_path)
    check_renderer(ctx.client.renderer, model_path)
    logger.info(f"rendering chats with renderer {ctx.client.renderer.name!r}, checked against the template")
    client = config.client
    servers = Servers(client.base_urls, client.timeout_s, config.model.name, client.stall_timeout_s, config.run_id)
    count = config.rollout_workers
    workers = RolloutWorkers(count, config, infra, model_path) if count > 1 else None
    if workers:
        logger.info(f"rollouts run in {count} worker processes")
    teacher = getattr(config, "teacher", None)  # an evaluation has none
    taught = None  # the teacher's key, or none (TeacherConfig.api_key_var): never the policy's
    if teacher:
        taught = at_server(ctx, f"{teacher.base_url}/v1", teacher.model, teacher.api_key_var or NO_API_KEY_VAR)
    return GroupRunner(servers, ctx, run_limits(config, infra), group_size, workers, config.output_dir, taught)


def busiest_share(before: dict[int, float], after: dict[int, float], seconds: float) -> float:
    """The share of a core that the busiest process used over ``seconds``, from :meth:`GroupRunner.rollout_cpu`
    before and after (a process started meanwhile counts from 0)."""
    used = [cpu - before.get(pid, 0.0) for pid, cpu in after.items()]
    return max(used, default=0.0) / max(seconds, 1e-9)


def track(progress: Progress, text: str, runs: list[asyncio.Future]) -> None:
    """Show ``text`` with how many of ``runs`` are done in ``progress``, until all are."""
    activity = progress.begin(text, total=len(runs), unit="groups")
    for run in runs:
        run.add_done_callback(lambda _: progress.advance(activity))
