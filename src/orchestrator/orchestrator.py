"""The rollout loop: keep the server's weights fresh enough, sample a batch, score it, write it for the trainer."""

import asyncio
import logging
import shutil
import time
from collections import Counter
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from contracts.errors import TridentError
from contracts.metrics import MetricsWriter, eval_line
from contracts.model_path import resolve_model_path
from contracts.progress import HEARTBEAT_S, Progress, last_written
from contracts.protocol import (
    BatchInfo,
    MicroBatch,
    Sample,
    latest_stable_weights,
    pack_samples,
    resume_step,
    sample_summary,
    wait_for,
    weights_dir,
    write_batch,
)
from orchestrator.advantage import group_advantages, group_rewards, uniform_groups
from orchestrator.ckpt import check_resumable, data_state, read_state, save_state
from orchestrator.config import AdvantageConfig, OrchestratorConfig
from orchestrator.difficulty_pool import DifficultyPool
from orchestrator.envs import Rollout, load_env, load_tasks, model_context, run_group, task_id
from orchestrator.evaluation import eval_scores, load_eval_sets
from orchestrator.infra import check_lost, infra_metrics, is_lost
from orchestrator.judge import check_judged
from orchestrator.limits import RolloutLimits, limit_generation
from orchestrator.refill import Slot, fill_slot, pool_results, refill_metrics
from orchestrator.renderer import check_renderer
from orchestrator.sample_rollouts import sample_rows
from orchestrator.servers import NoServer, ServerDown, Servers
from orchestrator.stats import advantage_metrics, env_metrics, rollout_metrics
from orchestrator.tasks import StepTasks, TaskSampler, prompts_per_env

logger = logging.getLogger("orchestrator")


def build_samples(
    groups: list[list[Rollout]],
    weight_step: int,
    mask_truncated: bool = False,
    zero_truncated: bool = False,
    advantage: AdvantageConfig | None = None,
) -> tuple[list[Sample], torch.Tensor, torch.Tensor]:
    """Training samples from groups of rollouts, with group-relative advantages; also the rewards and advantages
    (``[groups, rollouts]``) they were built from.

    ``zero_truncated`` scores rollouts cut off by max_tokens 0; ``mask_truncated`` trains none of their tokens.
    Failed rollouts (the environment raised) give no sample, and the baseline of their group is the others'.
    """
    rewards = torch.tensor([group_rewards(group, zero_truncated) for group in groups], dtype=torch.float32)
    advantage = advantage or AdvantageConfig()
    advantages = torch.zeros_like(rewards)
    for i, group in enumerate(groups):
        ok = torch.tensor([r.ok for r in group])
        if ok.any():
            advantages[i, ok] = group_advantages(rewards[i, ok][None], advantage)[0]
    dropped = uniform_groups(rewards).tolist() if advantage.drop_uniform_groups else [False] * len(groups)
    if all(dropped):  # keep a step whose groups all tie: it trains nothing, but the run goes on
        dropped = [False] * len(groups)
    samples = []
    for group, rewards_row, advantages_row, drop in zip(
        groups, rewards.tolist(), advantages.tolist(), dropped, strict=True
    ):
        if drop:
            continue
        for rollout, reward, advantage in zip(group, rewards_row, advantages_row, strict=True):
            if not rollout.ok:
                continue
            meta = {"env": rollout.env, "task": rollout.task, "rewards": rollout.rewards, "metrics": rollout.metrics,
                    "truncated": rollout.truncated, "turns": rollout.turns}  # fmt: skip
            for token_ids, mask, logprobs in rollout.branches:
                if mask_truncated and rollout.truncated:
                    mask = [False] * len(mask)
                samples.append(Sample(token_ids, mask, logprobs, advantage, reward, weight_step, meta))
    return samples, rewards, advantages


@dataclass
class StartedStep:
    """The groups of one step, started: running, or queued for ``max_concurrent``'s slots."""

    runs: list[asyncio.Future]  # one per place of the batch, each giving its Slot
    per_server: list[int]  # rollouts each server finished for the step
    weight_step: int  # the weights served when they started: the oldest that can have sampled their tokens
    start: float  # time.perf_counter() when they started
    wait_s: float  # seconds waited for the trainer's weights before they could start
    reload_s: float  # seconds the servers took to load those weights

    def cancel(self) -> None:
        for run in self.runs:
            run.cancel()


class Orchestrator:
    def __init__(self, config: OrchestratorConfig):
        self.config = config
        self.output_dir = config.output_dir
        self.envs = [load_env(env) for env in config.env]
        self.per_env = [load_tasks(env) for env in self.envs]
        for i, tasks in enumerate(self.per_env):
            if not tasks:
                raise TridentError(
                    f"env.{i}: environment {config.env[i].id!r} has no tasks (with args {config.env[i].args})"
                )
            check_judged(config.env[i], f"env.{i}", tasks[0])
        sizes = [len(tasks) for tasks in self.per_env]
        pool = config.difficulty_pool
        self.pool = DifficultyPool(sizes, pool.ema, pool.min_weight) if pool else None
        counts = prompts_per_env([env.share for env in config.env], config.batch_size)
        self.tasks = TaskSampler(sizes, counts, config.seed, self.pool)
        model_path = resolve_model_path(config.model.name)
        self.ctx = model_context(config, model_path)
        check_renderer(self.ctx.client.renderer, model_path)
        logger.info(f"rendering chats with renderer {self.ctx.client.renderer.name!r}, checked against the template")
        # only to show sample rollouts as text: training never detokenizes
        self.tokenizer = AutoTokenizer.from_pretrained(model_path) if config.sample_rollouts_every else None
        client = config.client
        self.servers = Servers(client.base_urls, client.timeout_s, config.model.name, self.ctx, client.stall_timeout_s)
        infra = config.infra
        self.limits = RolloutLimits.of(
            config.rollouts_in_flight, infra.max_concurrent_setups, infra.setup_timeout_s, infra.max_retries,
            infra.retry_backoff_s,
        )  # fmt: skip
        limit_generation(client.base_urls, client.max_concurrent_per_server)
        self.metrics = MetricsWriter(self.output_dir, "orchestrator", config.wandb)
        self.progress = Progress(self.output_dir, "orchestrator")
        self.served_step = 0
        self.probe_gap: float | None = None  # mean |logprob difference| on the probe after the last reload
        self.next_step: asyncio.Task | None = None  # the next step's StartedStep, started during this step
        self.eval_sets = load_eval_sets(config.eval) if config.eval else []
        self.evaluation: asyncio.Task | None = None  # the evaluation of the served weights, while it runs
        self.next_eval = 0  # the weights step from which the next evaluation is due
        self.written_at: float | None = None  # time.perf_counter() when the last batch was written

    def batch_tasks(self, step: int) -> list:
        """(environment, task) of each prompt of step ``step``."""
        return [(self.envs[e], self.per_env[e][task]) for e, task in self.tasks.step_tasks(step).tasks]

    def fill_slot(self, tasks: StepTasks, slot: int, per_server: list[int]) -> asyncio.Future:
        """Start sampling place ``slot`` of a step's batch (refilled as ``[filter]`` says)."""

        def run(env: int, task: int) -> Awaitable[list[Rollout]]:
            return self.run_group(self.envs[env], self.per_env[env][task], per_server=per_server)

        zero_truncated = self.config.zero_truncated_completions
        return asyncio.ensure_future(fill_slot(run, tasks, slot, self.config.filter, zero_truncated))

    async def update_weights(self, needed: int) -> tuple[float, float]:
        """Serve the newest weights, waiting for weights step ``needed`` or newer; returns (seconds waited, seconds
        reloading)."""
        start = time.perf_counter()
        if needed > self.served_step:
            with self.progress.doing(f"waiting for the trainer's weights step {needed}"):
                await asyncio.to_thread(
                    wait_for,
                    lambda: latest_stable_weights(self.output_dir) >= needed,
                    self.config.weights_timeout_s,
                    f"the trainer's weights {weights_dir(self.output_dir, needed)}/STABLE",
                    sign_of_life=lambda: last_written(self.output_dir, "trainer"),
                )
        waited = time.perf_counter() - start
        newest = latest_stable_weights(self.output_dir)
        if newest <= self.served_step:
            return waited, 0.0
        with self.progress.doing(f"waiting for the evaluation of weights step {self.served_step} to end"):
            await self.finish_evaluation()  # its rollouts all sample from the weights it is logged under
        path = weights_dir(self.output_dir, newest)
        with self.progress.doing(f"loading weights step {newest} into the server"):
            reload_s, gap = await self.servers.reload_weights(path, newest, self.config.client.probe_tolerance)
        self.probe_gap = gap
        count = len(self.servers.up)
        which = "server now serves" if len(self.servers.servers) == 1 else f"all {count} servers serve"
        logger.info(f"{which} weights step {newest} (reload {reload_s:.3f}s, probe gap {gap})")
        # Nothing can ask for older weights any more: the server moved past them. The folder served until now
        # goes at the next swap (requests admitted under a retired adapter may still read it).
        for old in range(1, newest):
            if old != self.served_step:
                shutil.rmtree(weights_dir(self.output_dir, old), ignore_errors=True)
        self.served_step = newest
        return waited, reload_s

    async def step_surviving_outage(self, step: int, start_next: bool = False) -> None:
        """Run a step; if no server answers, wait for one (``client.server_timeout_s``, backing off), bring it to
        this run's weights and run the step once more."""
        try:
            await self.step(step, start_next)
        except NoServer as e:
            timeout = self.config.client.server_timeout_s
            logger.warning(f"step {step}: {e}; waiting up to {timeout:.0f}s for one")
            with self.progress.doing(f"waiting up to {timeout:.0f}s for an inference server to answer"):
                await self.servers.wait_any(timeout)
            await self.step(step, start_next)

    async def start_groups(self, step: int) -> StartedStep:
        """Bring the servers to weights that step ``step`` may use (waiting for the trainer's), then start its
        groups."""
        served = weights_dir(self.output_dir, self.served_step) if self.served_step else None
        await self.servers.bring_to(served, self.served_step, self.config.client.probe_tolerance)
        wait_s, reload_s = await self.update_weights(step - 1 - self.config.async_level)
        per_server = [0] * len(self.servers.servers)
        tasks = self.tasks.step_tasks(step)
        runs = [self.fill_slot(tasks, slot, per_server) for slot in range(len(tasks.tasks))]
        self.track(f"sampling step {step}", runs)
        self.start_evaluation_if_due()
        return StartedStep(runs, per_server, self.served_step, time.perf_counter(), wait_s, reload_s)

    async def start_groups_in_tail(self, step: int, running: list[asyncio.Future]) -> StartedStep:
        """Start step ``step``'s groups once at most ``overlap_tail`` of the step before's groups (``running``) are
        left: the server's batch has room then. Sooner, they would only share the batch with this step's rollouts,
        the step's batch would come later, and so would the weights the step after next waits for."""
        left = int(self.config.overlap_tail * len(running))
        pending = [run for run in running if not run.done()]
        while len(pending) > left:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        return await self.start_groups(step)

    def start_evaluation_if_due(self) -> None:
        """Evaluate the served weights in the background once they reach the next multiple of ``eval.interval``
        (step 0 first)."""
        if not self.eval_sets or self.evaluation is not None or self.served_step < self.next_eval:
            return
        interval = self.config.eval.interval
        self.next_eval = (self.served_step // interval + 1) * interval
        self.evaluation = asyncio.create_task(self.evaluate(self.served_step))

    async def finish_evaluation(self) -> None:
        """Wait for the evaluation in flight, if any."""
        evaluation, self.evaluation = self.evaluation, None
        if evaluation is not None:
            await evaluation

    async def evaluate(self, weight_step: int) -> dict:
        """Score the served weights (``weight_step``) on every held-out task, k rollouts each; log the scores and
        return their record."""
        start = time.perf_counter()
        config = self.config.eval
        runs = [
            [asyncio.ensure_future(self.run_group(s.env, task, config.rollouts_per_example)) for task in s.tasks]
            for s in self.eval_sets
        ]
        self.track(f"evaluating weights step {weight_step}", [run for env_runs in runs for run in env_runs])
        groups = await asyncio.gather(*(asyncio.gather(*env_runs) for env_runs in runs))
        scores = {}
        for eval_set, env_groups in zip(self.eval_sets, groups, strict=True):
            scores |= eval_scores(eval_set.name, env_groups, config.pass_reward)
        record = {"step": weight_step, **scores, "eval/seconds": time.perf_counter() - start}
        self.metrics.write_eval(record)
        logger.info(eval_line(record))
        return record

    async def evaluate_final_weights(self) -> None:
        """Wait for the trainer's last weights, serve them, and evaluate them."""
        await self.update_weights(self.config.max_steps)
        await self.finish_evaluation()
        await self.evaluate(self.served_step)

    def track(self, text: str, runs: list[asyncio.Future]) -> None:
        """Show ``text`` with how many of ``runs`` are done in ``progress/orchestrator.json``, until all are."""
        activity = self.progress.begin(text, total=len(runs), unit="groups")
        for run in runs:
            run.add_done_callback(lambda _: self.progress.advance(activity))

    def cancel_next_step(self) -> None:
        """Stop the next step's groups, started early (this step failed, or the run stops)."""
        early, self.next_step = self.next_step, None
        if early is None:
            return
        if not early.done():
            early.cancel()
        elif not early.cancelled() and early.exception() is None:
            early.result().cancel()

    async def step(self, step: int, start_next: bool = False) -> None:
        """Sample, score and write the batch of step ``step``. With ``start_next``, step ``step + 1``'s groups
        start in this step's tail, once the servers serve weights it may use, to run while this step's last
        rollouts finish."""
        early, self.next_step = self.next_step, None
        started = None
        try:
            started = await (early if early is not None else self.start_groups(step))
            if start_next:
                self.next_step = asyncio.create_task(self.start_groups_in_tail(step + 1, started.runs))
            slots: list[Slot] = await asyncio.gather(*started.runs)
        except BaseException:  # no server left (or interrupted): the other groups of the step stop too
            if started is not None:
                started.cancel()
            self.cancel_next_step()
            raise
        weight_step, start = started.weight_step, started.start
        groups = [slot.group for slot in slots]
        check_lost(step, groups, self.config.infra.max_lost_groups)
        zero_truncated, refill = self.config.zero_truncated_completions, self.config.filter.refill
        if self.pool is not None:
            self.pool.record(step, pool_results(slots, zero_truncated))
        infra = infra_metrics(groups)
        self.log_infra(step, groups)
        groups = [group for group in groups if not is_lost(group)]
        started_early_s = max(0.0, self.written_at - start) if self.written_at is not None else 0.0
        generated = time.perf_counter()
        generate_s = generated - start
        per_server = started.per_server
        rollouts = [r for group in groups for r in group]
        failed = [r for r in rollouts if not r.ok]
        if len(failed) == len(rollouts):
            raise TridentError(
                f"step {step}: all {len(rollouts)} rollouts failed; first, in environment {failed[0].env!r} "
                f"(task {failed[0].task}): {failed[0].error}"
            )
        for error, count in Counter(f"environment {r.env!r}: {r.error}" for r in failed).items():
            logger.warning(f"step {step}: {count} rollouts failed in {error}")
        advantage = self.config.advantage
        if refill:  # what refilling could not replace is left out too
            advantage = advantage.model_copy(update={"drop_uniform_groups": True})
        samples, rewards, advantages = build_samples(
            groups,
            weight_step,
            mask_truncated=self.config.mask_truncated_completions,
            zero_truncated=zero_truncated,
            advantage=advantage,
        )
        overlong = sum(len(s.token_ids) > self.config.seq_len for s in samples)
        if overlong:
            logger.warning(f"step {step}: dropped {overlong} samples longer than seq_len = {self.config.seq_len}")
            samples = [s for s in samples if len(s.token_ids) <= self.config.seq_len]
        if not samples:
            reason = f"first error: {failed[0].error}" if failed else f"all longer than seq_len = {self.config.seq_len}"
            raise TridentError(f"step {step}: no rollout produced a training sample ({reason})")
        bins = pack_samples(samples, self.config.seq_len)
        micro_batches = [MicroBatch.pack(b) for b in bins]
        empty = sum(not any(s.loss_mask) for s in samples)
        if empty:
            logger.warning(f"step {step}: {empty} of {len(samples)} samples have no trainable token")
        metrics = {
            **rollout_metrics(groups, rewards, generate_s),
            **(env_metrics(groups, rewards, generate_s) if len(self.envs) > 1 else {}),
            **infra,
            **(refill_metrics(slots, zero_truncated) if refill else {}),
            **advantage_metrics(samples),
            "empty_samples": empty,
            "overlong_samples": overlong,
            **({"probe_gap": self.probe_gap} if self.probe_gap is not None else {}),
            "staleness": step - 1 - weight_step,
            "started_early_s": started_early_s,
        }
        info = BatchInfo(
            step=step,
            num_samples=len(samples),
            num_tokens=sum(len(s.token_ids) for s in samples),
            num_loss_tokens=sum(sum(s.loss_mask) for s in samples),
            reward_mean=metrics.pop("reward_mean"),
            temperature=self.config.sampling.temperature,
            weight_steps=[weight_step],
            metrics=metrics,
            samples=[sample_summary(s) for b in bins for s in b],
        )
        write_batch(self.output_dir, info, micro_batches)
        self.written_at = time.perf_counter()
        timings = {"wait_weights_s": started.wait_s, "reload_s": started.reload_s, "generate_s": generate_s,
                   "write_s": self.written_at - generated}  # fmt: skip
        self.metrics.write(
            {"step": step, "reward_mean": info.reward_mean, **info.metrics, "samples": info.num_samples,
             "tokens": info.num_tokens, "weight_step": weight_step, **timings}
        )  # fmt: skip
        every = self.config.sample_rollouts_every
        if every and (step - 1) % every == 0:
            rows = sample_rows(step, groups, rewards, advantages, self.decode)
            self.metrics.write_table("sample_rollouts", step, rows)
        logger.info(
            f"step {step} | reward {info.reward_mean:.4f} | samples {info.num_samples} | tokens {info.num_tokens} "
            f"| truncated {metrics['truncated_rate']:.0%} | weights step {weight_step} "
            f"| generate {generate_s:.2f}s"
            + (f" | refilled {metrics['refill/groups']} groups" if refill else "")
            + (f" (started {started_early_s:.2f}s early)" if started_early_s else "")
            + (f" | rollouts per server {'/'.join(map(str, per_server))}" if len(per_server) > 1 else "")
        )

    async def run_group(self, env, task, n: int | None = None, per_server: list[int] | None = None) -> list[Rollout]:
        """One group of ``n`` rollouts of ``task`` (default ``rollouts_per_example``), on the least loaded server;
        run again on another if that server is set aside before the group ends, or fails rollouts and then does not
        answer. ``per_server`` counts the rollouts each server finished (by its place in ``client.base_url``)."""
        n = n or self.config.rollouts_per_example
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

    def log_infra(self, step: int, groups: list[list[Rollout]]) -> None:
        """One line per environment whose rollouts met infrastructure errors: retries, lost groups, a cause."""
        by_env: dict[str, list[list[Rollout]]] = {}
        for group in groups:
            by_env.setdefault(group[0].env, []).append(group)
        for env, env_groups in by_env.items():
            retried = [r for group in env_groups for r in group if r.retries or r.lost]
            if retried:
                lost = sum(map(is_lost, env_groups))
                cause = next((r.error for r in retried if r.lost), None)
                logger.warning(
                    f"step {step}: environment {env!r}: {sum(r.retries for r in retried)} retries after "
                    f"infrastructure errors, {lost} of {len(env_groups)} groups lost" + (f" ({cause})" if cause else "")
                )

    def start_step(self) -> int:
        """The steps done before this run: 0, or the step of the checkpoint it resumes from (checked to have the
        same task order)."""
        ckpt = self.config.ckpt
        if ckpt is None or ckpt.resume_step is None:
            return 0
        step = resume_step(self.output_dir, ckpt.resume_step)
        check_resumable(self.output_dir, self.data_state(step))
        logger.info(f"resuming after step {step}: prompts from task {self.data_state(step)['tasks_consumed']} on")
        saved = read_state(self.output_dir, step).get("difficulty_pool")
        if self.pool is not None and saved is not None:
            self.pool.load_state_dict(saved)
            logger.info(f"difficulty pool restored: pass rates of {sum(map(len, self.pool.pass_rates))} tasks")
        elif self.pool is not None:
            logger.warning(f"the checkpoint of step {step} has no difficulty pool: it starts with no pass rates")
        return step

    def data_state(self, step: int) -> dict:
        config, pool = self.config, self.pool
        return data_state(step, config.batch_size, len(self.tasks), config.seed, self.tasks.counts,
                          pool.state_dict() if pool else None)  # fmt: skip

    def save_checkpoint(self, step: int) -> None:
        """The orchestrator's part of the checkpoint after ``step`` trainer steps, on the trainer's interval."""
        ckpt = self.config.ckpt
        if ckpt and (step % ckpt.interval == 0 or step == self.config.max_steps):
            save_state(self.output_dir, self.data_state(step))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def show_alive(self) -> None:
        """Rewrite the progress file every :data:`~contracts.progress.HEARTBEAT_S`: the trainer waits for a batch as
        long as the orchestrator shows it is alive, however long a step's rollouts take."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            self.progress.write()

    async def run(self) -> None:
        async with AsyncExitStack() as stack:
            heartbeat = asyncio.create_task(self.show_alive())
            stack.callback(heartbeat.cancel)
            logger.info(f"waiting for the inference server at {', '.join(self.config.client.base_urls)}")
            await self.servers.wait_ready(self.config.client.server_timeout_s)
            await self.servers.reset_weights()  # this run's weights come next; none of an earlier run's
            watch = asyncio.create_task(self.servers.watch())
            stack.callback(watch.cancel)
            for env in self.envs:
                await stack.enter_async_context(env.serving())
            stack.callback(self.cancel_next_step)
            stack.callback(lambda: self.evaluation and self.evaluation.cancel())
            overlap = self.config.overlap_steps and self.config.async_level > 0
            for step in range(self.start_step() + 1, self.config.max_steps + 1):
                await self.step_surviving_outage(step, start_next=overlap and step < self.config.max_steps)
                self.save_checkpoint(step)
            if self.eval_sets:
                await self.evaluate_final_weights()
        await self.servers.close()
        self.metrics.close()
        logger.info(f"wrote {self.config.max_steps} batches")
