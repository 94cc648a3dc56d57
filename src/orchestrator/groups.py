"""Groups of rollouts on the run's inference servers: what training steps and evaluations both sample with.

A group runs on the least loaded server that is up (:meth:`Servers.lease`) and runs again on another when its
server is set aside before it ends, or fails rollouts and then does not answer.
"""

import asyncio
import logging

from contracts.model_path import resolve_model_path
from contracts.progress import Progress
from orchestrator.config import EvalRunConfig, InfraConfig, OrchestratorConfig
from orchestrator.envs import Rollout, model_context, run_group, task_id
from orchestrator.limits import RolloutLimits, limit_generation
from orchestrator.renderer import check_renderer
from orchestrator.servers import ServerDown, Servers

logger = logging.getLogger("orchestrator")


class GroupRunner:
    """Runs groups of ``group_size`` rollouts (unless told otherwise) on ``servers``, within ``limits``."""

    def __init__(self, servers: Servers, limits: RolloutLimits, group_size: int):
        self.servers = servers
        self.limits = limits
        self.group_size = group_size

    async def run(self, env, task, n: int | None = None, per_server: list[int] | None = None) -> list[Rollout]:
        """One group of ``n`` rollouts of ``task`` (default ``group_size``), on the least loaded server; run again
        on another if that server is set aside before the group ends, or fails rollouts and then does not answer.
        ``per_server`` counts the rollouts each server finished (by its place in ``client.base_url``)."""
        n = n or self.group_size
        while True:
            async with self.servers.lease() as server:
                try:
                    call = run_group(env, task, n, self.servers.context(server), self.limits)
                    rollouts = await self.servers.guard(server, call)
                except ServerDown:
                    rollouts = None
                if rollouts is not None and (all(r.ok for r in rollouts) or await self.servers.answers(server)):
                    if per_server is not None:
                        per_server[self.servers.servers.index(server)] += n
                    return rollouts
            logger.warning(f"a group of task {task_id(task.data)} runs again on another server")


def connect(config: OrchestratorConfig | EvalRunConfig, infra: InfraConfig, group_size: int) -> GroupRunner:
    """A :class:`GroupRunner` on the servers of ``config.client`` (not yet asked anything), sampling as
    ``config.sampling`` says through the model's renderer, checked against its chat template first."""
    model_path = resolve_model_path(config.model.name)
    ctx = model_context(config, model_path)
    check_renderer(ctx.client.renderer, model_path)
    logger.info(f"rendering chats with renderer {ctx.client.renderer.name!r}, checked against the template")
    client = config.client
    servers = Servers(client.base_urls, client.timeout_s, config.model.name, ctx, client.stall_timeout_s)
    limits = RolloutLimits.of(
        client.rollouts_in_flight(config.max_concurrent), infra.max_concurrent_setups, infra.setup_timeout_s,
        infra.max_retries, infra.retry_backoff_s,
    )  # fmt: skip
    limit_generation(client.base_urls, client.max_concurrent_per_server)
    return GroupRunner(servers, limits, group_size)


def track(progress: Progress, text: str, runs: list[asyncio.Future]) -> None:
    """Show ``text`` with how many of ``runs`` are done in ``progress``, until all are."""
    activity = progress.begin(text, total=len(runs), unit="groups")
    for run in runs:
        run.add_done_callback(lambda _: progress.advance(activity))
