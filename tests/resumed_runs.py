"""What a resumed run is checked against: the tasks each step of a run never stopped draws, computed in the test's
process from the run's config with the orchestrator's own sampler (no run, no server), beside the tasks a run's kept
batches hold; and an orchestrator's steps run as its loop runs them, stopped after any checkpoint."""

import json
from pathlib import Path

from contracts.config import parse_config
from contracts.run_dir import checkpoint_dir, configs_dir, mark_stable, rollouts_dir, weights_dir
from orchestrator.config import OrchestratorConfig, prompts_per_env
from orchestrator.tasks.difficulty_pool import DifficultyPool
from orchestrator.tasks.sampler import TaskSampler
from orchestrator.verifiers_adapter.envs import load_env, task_id, tasks_of


def batch_tasks(output_dir: Path, step: int) -> list[str]:
    """The task id of each sample of step ``step``'s batch (``rollouts/step_N/batch.json``), in packed order."""
    batch = json.loads((rollouts_dir(output_dir, step) / "batch.json").read_text())
    return [sample["task"] for sample in batch["samples"]]


async def run_steps(orchestrator, steps: int, stop_at: int | None = None) -> list[int]:
    """Steps as Orchestrator.run runs them (the next step's groups start in this one's tail), a checkpoint after
    each (the trainer's part and weights faked), until ``stop_at``; the tasks the first environment held after each
    step (before its checkpoint, which reads the task the next step goes on from)."""
    held = []
    for step in range(orchestrator.start_step() + 1, steps + 1):
        await orchestrator.step(step, start_next=step < steps)
        held.append(orchestrator.per_env[0].held)
        orchestrator.save_checkpoint(step)
        for folder in (
            checkpoint_dir(orchestrator.output_dir, step) / "trainer",
            weights_dir(orchestrator.output_dir, step),
        ):
            folder.mkdir(parents=True, exist_ok=True)
            mark_stable(folder)
        if step == stop_at:
            break
    return held


def run_config(output_dir: Path) -> OrchestratorConfig:
    """The orchestrator config ``rl`` resolved and wrote for the run in ``output_dir``."""
    return parse_config(OrchestratorConfig, ["@", str(configs_dir(output_dir) / "orchestrator.toml")])


def uninterrupted_tasks(config: OrchestratorConfig, steps: range) -> dict[int, list[str]]:
    """The task ids each step of ``steps`` draws in a run of ``config`` never stopped, in the order of its places: the
    sampler built from the config's environments, shares, batch size and seed alone. Only for a run whose steps are a
    pure function of the step (no ``[filter] refill``, no ``[difficulty_pool]``: those draw by the rewards)."""
    if config.filter.refill or config.difficulty_pool is not None:
        raise ValueError("refill and the difficulty pool draw by the rewards: no reference without a run")
    per_env, sampler = run_sampler(config)
    return {step: [task_id(per_env[e][task].data) for e, task in sampler.step_tasks(step).tasks] for step in steps}


def drawable_tasks(config: OrchestratorConfig, step: int, pool_state: dict | None = None) -> list[set[str]]:
    """Each place of step ``step``'s batch in a run of ``config``: the task ids that may fill it, its own and its
    ``[filter]`` refill replacements, as the orchestrator's sampler draws them for a run never stopped; with
    ``[difficulty_pool]``, by the pool as ``pool_state`` holds it (a checkpoint's, of step ``step - 1``)."""
    per_env, sampler = run_sampler(config, pool_state)
    tasks, places = sampler.step_tasks(step), []
    for slot, own in enumerate(tasks.tasks):
        replacements = [tasks.replacement(slot, attempt, []) for attempt in range(1, sampler.attempts)]
        places.append({task_id(per_env[e][task].data) for e, task in [own, *replacements]})
    return places


def assert_drawn(drawn: list[str], places: list[set[str]], rollouts: int) -> None:
    """A batch's task ids (``drawn``, one a sample) fill the ``places`` of :func:`drawable_tasks`: each task is one
    of a place's, at most one task a place, each task's group whole (``rollouts`` samples of one branch each)."""
    assert all(drawn.count(task) == rollouts for task in drawn), drawn
    assert all(len(place & set(drawn)) <= 1 for place in places), (drawn, places)
    assert set(drawn) <= set.union(*places), (drawn, places)


def run_sampler(config: OrchestratorConfig, pool_state: dict | None = None) -> tuple[list, TaskSampler]:
    """The tasks of each environment of ``config`` and the sampler an uninterrupted run of it draws with (its
    difficulty pool as ``pool_state`` holds it)."""
    per_env = [tasks_of(load_env(env)) for env in config.env]
    sizes = [tasks.size for tasks in per_env]
    counts = prompts_per_env([env.share for env in config.env], config.batch_size)
    attempts = config.filter.max_attempts if config.filter.refill else 1
    pool, window = None, 0
    if config.difficulty_pool is not None:
        pool, window = (
            DifficultyPool(sizes, config.difficulty_pool.ema, config.difficulty_pool.min_weight),
            config.difficulty_pool.stream_window,
        )
        pool.load_state_dict(pool_state)
    return per_env, TaskSampler(sizes, counts, config.seed, pool, attempts, window)
