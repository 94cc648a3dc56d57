"""The rollout loop: keep the server's weights fresh enough, sample a batch, score it, write it for the trainer.

The parts, each usable alone: :mod:`~orchestrator.loop.groups` (groups of rollouts on the servers),
:mod:`~orchestrator.serving.weight_sync` (the served weights), :mod:`~orchestrator.loop.schedule` (when each step's
groups start), :mod:`~orchestrator.loop.evaluation` (held-out scores) and :mod:`~orchestrator.batching.batch` (the
batch, from the groups).
"""

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import replace

from transformers import AutoTokenizer

from contracts.chat_family import resolve_family
from contracts.chat_turns import ChatFormat
from contracts.checkpoint import checkpoint_due
from contracts.errors import TridentError
from contracts.inference_api import API_KEY_ENV
from contracts.metrics import MetricsWriter
from contracts.model_card import ModelCard
from contracts.progress import HEARTBEAT_S, Progress
from contracts.protocol import write_batch
from contracts.run_dir import resume_step, weights_dir
from orchestrator.batching.batch import assemble_batch
from orchestrator.batching.causes import causes
from orchestrator.batching.distill import reverse_kl_metrics
from orchestrator.batching.echo import set_echo_weights
from orchestrator.batching.images import decoded_with_images
from orchestrator.batching.infra import check_lost, infra_metrics, is_lost
from orchestrator.batching.no_sample import no_sample_metrics, untrained_summary
from orchestrator.batching.rollout import Rollout
from orchestrator.batching.running_baseline import RunningBaselines
from orchestrator.batching.teacher_samples import set_teacher_sample_weights
from orchestrator.config import OrchestratorConfig, TeacherConfig, prompts_per_env
from orchestrator.loop.ckpt import Checkpointer
from orchestrator.loop.evaluation import Evaluation
from orchestrator.loop.groups import busiest_share, connect
from orchestrator.loop.refill import Slot, pool_results, refill_metrics
from orchestrator.loop.schedule import StepSchedule
from orchestrator.metrics.failed_rollouts import write_failed_rollouts
from orchestrator.metrics.memory import StepMemory
from orchestrator.metrics.sample_rollouts import sample_rows
from orchestrator.metrics.stats import advantage_metrics, env_metrics, rollout_metrics, token_staleness_metrics
from orchestrator.serving.run_share import ShareMeter
from orchestrator.serving.servers import NoServer
from orchestrator.serving.teacher import Teacher
from orchestrator.serving.weight_sync import WeightSync
from orchestrator.tasks.difficulty_pool import DifficultyPool
from orchestrator.tasks.sampler import TaskFeed, TaskSampler
from orchestrator.verifiers_adapter.envs import load_env, task_id, tasks_of
from orchestrator.verifiers_adapter.judge import check_judged
from orchestrator.verifiers_adapter.prompt_images import check_model_sees_images

logger = logging.getLogger("orchestrator")
CPU_BOUND_SHARE = 0.9  # of a core, busy with rollouts: the process that runs them holds them up


def slots_by_algorithm(slots: list[Slot], config: OrchestratorConfig) -> dict[str, list[Slot]]:
    """``slots`` by the algorithm of the environment of their finished group."""
    by_algorithm: dict[str, list[Slot]] = {}
    for slot in slots:
        by_algorithm.setdefault(config.env_algorithm(slot.tries[-1][0]), []).append(slot)
    return by_algorithm


class Orchestrator:
    def __init__(self, config: OrchestratorConfig):
        self.config = config
        self.output_dir = config.output_dir
        self.envs = [load_env(env) for env in config.env]
        self.per_env = [tasks_of(env) for env in self.envs]
        for i, tasks in enumerate(self.per_env):
            if tasks.size == 0:
                raise TridentError(
                    f"env.{i}: environment {config.env[i].id!r} has no tasks (with args {config.env[i].args})"
                )
            check_judged(config.env[i], f"env.{i}", tasks[0])
            check_model_sees_images(config.env[i].id, f"env.{i}", tasks[0], config.model.name)
        sizes = [tasks.size for tasks in self.per_env]
        pool = config.difficulty_pool
        self.pool = DifficultyPool(sizes, pool.ema, pool.min_weight) if pool else None
        counts = prompts_per_env([env.share for env in config.env], config.batch_size)
        attempts = config.filter.max_attempts if config.filter.refill else 1
        self.tasks = TaskSampler(sizes, counts, config.seed, self.pool, attempts, pool.stream_window if pool else 0)
        self.feed = TaskFeed(self.per_env, self.tasks, config.max_steps)
        advantage = config.advantage
        self.running = RunningBaselines(advantage.running_decay) if advantage.baseline == "running" else None
        self.checkpointer = Checkpointer(self.output_dir, [self.feed, *([self.running] if self.running else [])])
        self.groups = connect(config, config.infra, config.rollouts_per_example)
        self.servers = self.groups.servers
        self.share = ShareMeter(self.servers)
        card = ModelCard.of(config.model.name)
        model_path = card.path
        # what the server samples from: the batch files carry it for the trainer to replay (vision markers banned)
        self.truncation = replace(config.sampling.truncation, banned=tuple(sorted(card.vision_markers())))
        algorithms = set(map(config.env_algorithm, range(len(config.env))))
        # loaded once, for what reads text: sample rollouts, ECHO's chat turns, opsd's demonstration (training never
        # detokenizes)
        needed = config.sample_rollouts_every or algorithms & {"echo", "opsd"}
        self.tokenizer = AutoTokenizer.from_pretrained(model_path) if needed else None
        family = resolve_family(config.model.chat_family, model_path)
        image_pad = family.image_pad if self.tokenizer and family else None
        self.image_pad = self.tokenizer.convert_tokens_to_ids(image_pad) if image_pad else None
        self.metrics = MetricsWriter(self.output_dir, "orchestrator", config.wandb)
        self.progress = Progress(self.output_dir, "orchestrator")
        self.evaluation = Evaluation(config.eval, config.model.name, self.groups, self.metrics, self.progress)
        client = config.client
        self.weights = WeightSync(self.output_dir, self.servers, self.progress, config.weights_timeout_s,
                                  client.probe_tolerance, self.evaluation.finish,
                                  config.weight_sync.in_flight)  # fmt: skip
        self.schedule = StepSchedule(config, self.groups, self.weights, self.evaluation, self.tasks, self.envs,
                                     self.per_env, self.progress)  # fmt: skip
        self.written_at: float | None = None  # time.perf_counter() when the last batch was written
        self.cpu_mark = (time.perf_counter(), self.groups.rollout_cpu())  # when, and the rollout processes' CPU
        self.cpu_hinted = False
        self.memory = StepMemory(config.max_memory_growth_gib)
        teacher, run_id = config.teacher, config.run_id
        self.teacher = Teacher(teacher, config.client.base_urls[0], run_id) if teacher else None
        self.chat = None  # ECHO's weights follow the chat turns
        if "echo" in algorithms:
            self.chat = ChatFormat.from_tokenizer(self.tokenizer, family)
        self.self_teacher = None
        if "opsd" in algorithms:  # the policy's server scores, through the chat template of the demonstration
            policy = TeacherConfig(base_url=config.client.base_urls[0], model=config.model.name,
                                   api_key_var=API_KEY_ENV)  # fmt: skip
            self.self_teacher = Teacher(policy, config.client.base_urls[0])

    def batch_tasks(self, step: int) -> list:
        """(environment, task) of each prompt of step ``step``."""
        return [(self.envs[e], self.per_env[e][task]) for e, task in self.tasks.step_tasks(step).tasks]

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

    async def evaluate_final_weights(self) -> None:
        """Wait for the trainer's last weights, serve them, and evaluate them."""
        await self.weights.update(self.config.max_steps)
        await self.evaluation.finish()
        await self.evaluation.evaluate(self.weights.served_step)

    async def step(self, step: int, start_next: bool = False) -> None:
        """Sample, score and write the batch of step ``step``. With ``start_next``, step ``step + 1``'s groups
        start in this step's tail, once the servers serve weights it may use, to run while this step's last
        rollouts finish."""
        started, slots = await self.schedule.sample(step, start_next)
        weight_step, start = started.weight_step, started.start
        groups = [slot.group for slot in slots]
        write_failed_rollouts(self.output_dir, step, groups)  # before anything may stop the run
        check_lost(step, groups, self.config.infra.max_lost_groups)
        zero_truncated, refill = self.config.zero_truncated_completions, self.config.filter.refill
        if self.pool is not None:
            self.pool.record(step, pool_results(slots, zero_truncated))
        infra = infra_metrics(groups)
        self.log_infra(step, groups)
        started_early_s = max(0.0, self.written_at - start) if self.written_at is not None else 0.0
        generated = time.perf_counter()
        generate_s = generated - start
        per_server = started.per_server
        advantage = self.config.advantage
        if refill:  # what refilling could not replace is left out too
            advantage = advantage.model_copy(update={"drop_uniform_groups": True})
        by_algorithm = slots_by_algorithm(slots, self.config)
        distill_coef = 1.0
        if self.teacher is not None:  # its scores are the opd environments' advantages: counted in write_s
            await self.teacher.score([s.group for s in by_algorithm.get("opd", [])])
            distill_coef = self.teacher.config.coef
        if self.self_teacher is not None:  # the policy shown each task's demonstration scores its samples
            opsd = by_algorithm.get("opsd", [])
            await self.self_teacher.score([s.group for s in opsd], [self.demonstration(s) for s in opsd])
        set_teacher_sample_weights([s.group for s in by_algorithm.get("sft", [])])
        if self.chat is not None:
            echo = [s.group for s in by_algorithm.get("echo", [])]
            set_echo_weights(echo, self.chat, self.config.echo.roles, self.config.echo.coef)
        batch = assemble_batch(step, groups, weight_step, self.config.seq_len, advantage,
                               self.config.mask_truncated_completions, zero_truncated, self.running,
                               distill_coef)  # fmt: skip
        groups, rewards, samples = batch.groups, batch.rewards, batch.samples
        for env in dict.fromkeys(r.env for r in batch.failed):
            for cause in causes([r for r in batch.failed if r.env == env]):
                logger.warning(f"step {step}: {cause.count} rollouts failed in environment {env!r}: {cause.text}")
        unlogged = [u for u in batch.untrained if u.reason not in ("failed", "lost")]  # those are logged apart
        if unlogged:
            summary = untrained_summary(unlogged, self.config.seq_len)
            logger.warning(f"step {step}: {len(unlogged)} rollouts trained nothing: {summary}")
        if batch.overlong:
            logger.warning(f"step {step}: dropped {batch.overlong} samples longer than seq_len = {self.config.seq_len}")
        if batch.empty:
            logger.warning(f"step {step}: {batch.empty} of {len(samples)} samples have no trainable token")
        metrics = {
            **rollout_metrics(groups, rewards, generate_s),
            **(env_metrics(groups, rewards, generate_s) if len(self.envs) > 1 else {}),
            **infra,
            **(refill_metrics(slots, zero_truncated, advantage.baseline_groups) if refill else {}),
            **advantage_metrics(samples),
            **(self.running.metrics() if self.running else {}),
            **reverse_kl_metrics(groups),
            "empty_samples": batch.empty,
            "overlong_samples": batch.overlong,
            **no_sample_metrics(batch.untrained),
            **({"probe_gap": self.weights.probe_gap} if self.weights.probe_gap is not None else {}),
            "staleness": step - 1 - weight_step,
            **token_staleness_metrics(step, samples),
            "started_early_s": started_early_s,
            "rollout_cpu_share": self.rollout_cpu_share(step),
        }
        temperature = self.config.sampling.temperature
        info = batch.info(step, temperature, metrics.pop("reward_mean"), metrics, self.truncation)
        write_batch(self.output_dir, info, batch.micro_batches)
        self.feed.finish(step)
        self.written_at = time.perf_counter()
        timings = {"wait_weights_s": started.wait_s, "reload_s": started.reload_s, "reload_paused_s": started.paused_s,
                   "generate_s": generate_s, "write_s": self.written_at - generated}  # fmt: skip
        self.metrics.write(
            {"step": step, "reward_mean": info.reward_mean, **info.metrics, "samples": info.num_samples,
             "tokens": info.num_tokens, "weight_step": weight_step, **timings, **self.memory_metrics(step),
             **await self.share.step_metrics()}
        )  # fmt: skip
        every = self.config.sample_rollouts_every
        if every and (step - 1) % every == 0:
            rows = sample_rows(step, groups, rewards, batch.advantages, self.decode)
            self.metrics.write_table("sample_rollouts", step, rows)
        logger.info(
            f"step {step} | reward {info.reward_mean:.4f} | samples {info.num_samples} | tokens {info.num_tokens} "
            f"| truncated {metrics['truncated_rate']:.0%} | weights step {weight_step} "
            f"| generate {generate_s:.2f}s"
            + (f" | refilled {metrics['refill/groups']} groups" if refill else "")
            + (f" (started {started_early_s:.2f}s early)" if started_early_s else "")
            + (f" | rollouts per server {'/'.join(map(str, per_server))}" if len(per_server) > 1 else "")
        )

    def memory_metrics(self, step: int) -> dict[str, float]:
        """The orchestrator's resident memory after step ``step`` (bounded:
        :class:`~orchestrator.metrics.memory.StepMemory`) and the tasks its task streams hold."""
        held = [(env.id, tasks.held) for env, tasks in zip(self.config.env, self.per_env, strict=True)]
        resident = self.memory.after_step(step, held)
        streams = [tasks.held for tasks in self.per_env if tasks.size is None]
        return ({"resident_gib": resident} if resident is not None else {}) | (
            {"stream_tasks_held": sum(streams)} if streams else {}
        )

    def rollout_cpu_share(self, step: int) -> float:
        """The share of a core that the busiest process running rollouts used since the previous step (1.0: a
        whole one). Past step 1 (which includes start-up), :data:`CPU_BOUND_SHARE` or more is logged once, with what
        to do about it."""
        then, before = self.cpu_mark
        self.cpu_mark = (now, after) = (time.perf_counter(), self.groups.rollout_cpu())
        share = busiest_share(before, after, now - then)
        if share >= CPU_BOUND_SHARE and step > 1 and not self.cpu_hinted:
            self.cpu_hinted = True
            who = "the orchestrator's process" if self.groups.workers is None else "a rollout worker"
            logger.warning(
                f"step {step}: {who} kept {share:.0%} of a core busy running rollouts, which wait for its CPU: "
                "more orchestrator.rollout_workers spread them over more cores (docs/scaling.md#rollout-workers)"
            )
        return share

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
        self.checkpointer.load(step)
        return step

    def save_checkpoint(self, step: int) -> None:
        """The orchestrator's part of the checkpoint after ``step`` trainer steps, on the trainer's interval."""
        if checkpoint_due(self.config.ckpt, step, self.config.max_steps):
            self.checkpointer.save(step)

    def demonstration(self, slot: Slot) -> list[int]:
        """The tokens self-distillation shows before the rollouts of ``slot``'s group: a system turn holding its task's
        demonstration (``[self_distill]``); one line naming the task and key when its data has none."""
        env, task, _ = slot.tries[-1]
        data, key = self.per_env[env][task].data, self.config.self_distill.demonstration_key
        value = getattr(data, key, None)
        if value is None:
            raise TridentError(
                f"env.{env} ({self.config.env[env].id!r}): task {task_id(data)} has no {key!r} to show as its "
                "demonstration (self_distill.demonstration_key)"
            )
        text = self.config.self_distill.template.replace("{demonstration}", str(value))
        turn = self.tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False)
        return self.tokenizer.encode(turn, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return decoded_with_images(token_ids, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
                                   self.image_pad)  # fmt: skip

    async def show_alive(self) -> None:
        """Rewrite the progress file every :data:`~contracts.progress.HEARTBEAT_S`: the trainer waits for a batch as
        long as the orchestrator shows it is alive, however long a step's rollouts take."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            self.progress.write()

    async def run(self) -> None:
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self.servers.release_run)  # last, however the run ends: a named run has ended
            heartbeat = asyncio.create_task(self.show_alive())
            stack.callback(heartbeat.cancel)
            logger.info(f"waiting for the inference server at {', '.join(self.config.client.base_urls)}")
            await self.servers.wait_ready(self.config.client.server_timeout_s)
            await self.servers.serve_base_model(weights_dir(self.output_dir, 0).parent, self.config.reset)
            if self.teacher is not None:
                stack.push_async_callback(self.teacher.close)
                await self.teacher.start(self.servers.servers[0].client.http, self.config.model.name, self.output_dir,
                                         self.config.client.server_timeout_s)  # fmt: skip
            if self.self_teacher is not None:
                stack.push_async_callback(self.self_teacher.close)
            await self.share.start()
            watch = asyncio.create_task(self.servers.watch())
            stack.callback(watch.cancel)
            stack.push_async_callback(self.groups.close)
            for env in self.envs:
                await stack.enter_async_context(env.serving())
            stack.callback(self.schedule.cancel_next)
            stack.callback(self.evaluation.cancel)
            overlap = self.config.overlap_steps and self.config.async_level > 0
            for step in range(self.start_step() + 1, self.config.max_steps + 1):
                await self.step_surviving_outage(step, start_next=overlap and step < self.config.max_steps)
                self.save_checkpoint(step)
            if self.evaluation.sets:
                await self.evaluate_final_weights()
        await self.servers.close()
        self.metrics.close()
        logger.info(f"wrote {self.config.max_steps} batches")
