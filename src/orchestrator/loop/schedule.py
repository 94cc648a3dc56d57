"""When each step's groups start: once the servers serve weights the step may use (waiting for the trainer's),
and with ``overlap_steps`` the next step's in this step's tail (``overlap_tail``), while its last rollouts finish.
"""

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from contracts.progress import Progress
from orchestrator.batching.rollout import Rollout
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.evaluation import Evaluation
from orchestrator.loop.groups import GroupRunner, track
from orchestrator.loop.refill import Slot, fill_slot
from orchestrator.serving.weight_sync import WeightSync
from orchestrator.tasks.sampler import StepTasks, TaskSampler
from orchestrator.tasks.stream import Tasks
from orchestrator.verifiers_adapter.envs import Env


@dataclass
class StartedStep:
    """The groups of one step, started: running, or queued for ``max_concurrent``'s slots."""

    runs: list[asyncio.Future]  # one per place of the batch, each giving its Slot
    per_server: list[int]  # rollouts each server finished for the step
    weight_step: int  # the weights served when they started: the oldest that can have sampled their tokens
    start: float  # time.perf_counter() when they started
    wait_s: float  # seconds waited for the trainer's weights before they could start
    reload_s: float  # seconds the servers took to load those weights
    paused_s: float  # seconds generation was paused for that reload (the longest of the servers')

    def cancel(self) -> None:
        for run in self.runs:
            run.cancel()


class StepSchedule:
    """Starts the groups of each step (the tasks ``tasks`` draws, of ``envs``, ``per_env`` their tasks) on
    ``groups``, once ``weights`` serves weights the step may use; the evaluation of those weights starts after them
    when it is due."""

    def __init__(
        self,
        config: OrchestratorConfig,
        groups: GroupRunner,
        weights: WeightSync,
        evaluation: Evaluation,
        tasks: TaskSampler,
        envs: list[Env],
        per_env: list[Tasks],
        progress: Progress,
    ):
        self.config, self.groups, self.weights, self.evaluation = config, groups, weights, evaluation
        self.tasks, self.envs, self.per_env, self.progress = tasks, envs, per_env, progress
        self.next_step: asyncio.Task | None = None  # the next step's StartedStep, started during this step

    async def sample(self, step: int, start_next: bool = False) -> tuple[StartedStep, list[Slot]]:
        """Step ``step``'s groups, started now (or in the step before's tail) and finished: one Slot per place of
        the batch. With ``start_next``, step ``step + 1``'s groups start in this step's tail. If a group fails (no
        server left) or this is cancelled, the step's other groups and the next step's stop too."""
        early, self.next_step = self.next_step, None
        started = None
        try:
            started = await (early if early is not None else self.start(step))
            if start_next:
                self.next_step = asyncio.create_task(self.start_in_tail(step + 1, started.runs))
            return started, await asyncio.gather(*started.runs)
        except BaseException:
            if started is not None:
                started.cancel()
            self.cancel_next()
            raise

    def fill_slot(self, tasks: StepTasks, slot: int, per_server: list[int]) -> asyncio.Future:
        """Start sampling place ``slot`` of a step's batch (refilled as ``[filter]`` says)."""

        def run(env: int, task: int) -> Awaitable[list[Rollout]]:
            algorithm = self.config.env_algorithm(env)
            return self.groups.run(self.envs[env], self.per_env[env][task], per_server=per_server, algorithm=algorithm)

        zero_truncated, by = self.config.zero_truncated_completions, self.config.advantage.baseline_groups
        return asyncio.ensure_future(fill_slot(run, tasks, slot, self.config.filter, zero_truncated, by))

    async def start(self, step: int) -> StartedStep:
        """Bring the servers to weights that step ``step`` may use (waiting for the trainer's), then start its
        groups."""
        await self.weights.bring_servers_back()
        wait_s, reload_s = await self.weights.update(step - 1 - self.config.async_level)
        per_server = [0] * len(self.groups.servers.servers)
        tasks = self.tasks.step_tasks(step)
        runs = [self.fill_slot(tasks, slot, per_server) for slot in range(len(tasks.tasks))]
        track(self.progress, f"sampling step {step}", runs)
        self.evaluation.start_if_due(self.weights.served_step)
        return StartedStep(runs, per_server, self.weights.served_step, time.perf_counter(), wait_s, reload_s,
                           self.weights.paused_s)  # fmt: skip

    async def start_in_tail(self, step: int, running: list[asyncio.Future]) -> StartedStep:
        """Start step ``step``'s groups once at most ``overlap_tail`` of the step before's groups (``running``) are
        left: the server's batch has room then. Sooner, they would only share the batch with this step's rollouts,
        the step's batch would come later, and so would the weights the step after next waits for."""
        left = int(self.config.overlap_tail * len(running))
        pending = [run for run in running if not run.done()]
        while len(pending) > left:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        return await self.start(step)

    def cancel_next(self) -> None:
        """Stop the next step's groups, started early (this step failed, or the run stops)."""
        early, self.next_step = self.next_step, None
        if early is None:
            return
        if not early.done():
            early.cancel()
        elif not early.cancelled() and early.exception() is None:
            early.result().cancel()
