import asyncio
import json
import random

import pytest
from debug_configs import FILES
from resumed_runs import assert_drawn, batch_tasks, drawable_tasks, run_config, run_steps, uninterrupted_tasks
from rollouts import ONE_SAMPLED, group
from trainer_runs import write_orchestrator_part

import orchestrator.loop.groups as groups_module
from contracts.config import parse_config
from contracts.errors import TridentError
from contracts.run_dir import checkpoint_dir, clear_run_state, complete_checkpoints
from launch.launcher import resume_point, run
from launch.rl_config import RLConfig, resolve_shared
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.ckpt import Checkpointer, read_state
from orchestrator.tasks.difficulty_pool import DifficultyPool
from orchestrator.tasks.sampler import TaskFeed, TaskSampler
from orchestrator.tasks.stream import TaskList


def feed(sizes: list[int], counts: list[int], seed: int, step: int = 0) -> TaskFeed:
    """The tasks of a run of finite tasksets of ``sizes``, ``counts`` prompts a step from each, after ``step``."""
    tasks = TaskFeed([TaskList(list(range(size))) for size in sizes], TaskSampler(sizes, counts, seed), last_step=10)
    tasks.finish(step)
    return tasks


def test_orchestrator_part_records_the_data_position_atomically(tmp_path):
    folder = Checkpointer(tmp_path, [feed([60, 40], counts=[6, 2], seed=3, step=4)]).save(4)
    assert folder == checkpoint_dir(tmp_path, 4) / "orchestrator"
    assert json.loads((folder / "state.json").read_text()) == {
        "step": 4, "tasks_consumed": 32, "num_tasks": 100, "seed": 3, "prompts_per_env": [6, 2]
    }  # fmt: skip
    assert (folder / "STABLE").exists()
    assert [p.name for p in folder.parent.iterdir()] == ["orchestrator"]  # no temporary folder left


def test_resume_refuses_a_changed_task_order(tmp_path):
    Checkpointer(tmp_path, [feed([100], [8], seed=3, step=4)]).save(4)
    resumed = feed([100], [8], seed=3)
    Checkpointer(tmp_path, [resumed]).load(4)
    assert resumed.step == 4
    with pytest.raises(TridentError, match=r"task order changed \(num_tasks 100 -> 90, seed 3 -> 4\)"):
        Checkpointer(tmp_path, [feed([90], [8], seed=4)]).load(4)
    with pytest.raises(TridentError, match=r"task order changed \(prompts_per_env \[8\] -> \[6, 2\]\)"):
        Checkpointer(tmp_path, [feed([60, 40], [6, 2], seed=3)]).load(4)


def test_a_checkpoint_written_before_loads_and_is_written_back_byte_for_byte(tmp_path):
    """The orchestrator's part as runs wrote it before its parts gave their own state (a literal copy, with a
    difficulty pool): it loads, and the same run's tasks write the same file; one older still (before environment
    shares, no ``prompts_per_env``) loads too."""
    pool = {"pass_rates": [{"5": 0.5, "12": 0.25}], "pending": {"4": [[0, 7, 1.0]], "5": [[0, 3, 0.0]]}}
    written = {"step": 4, "tasks_consumed": 32, "num_tasks": 100, "seed": 3, "prompts_per_env": [8],
               "difficulty_pool": pool}  # fmt: skip
    old = tmp_path / "old"
    (checkpoint_dir(old, 4) / "orchestrator").mkdir(parents=True)
    (checkpoint_dir(old, 4) / "orchestrator" / "state.json").write_text(json.dumps(written, indent=2))
    tasks = feed([100], [8], seed=3)
    tasks.sampler.pool = DifficultyPool([100], ema=0.5, min_weight=0.05)
    Checkpointer(old, [tasks]).load(4)
    assert tasks.sampler.pool.pass_rates == [{5: 0.5, 12: 0.25}]
    folder = Checkpointer(tmp_path / "new", [tasks]).save(4)
    assert (folder / "state.json").read_bytes() == (checkpoint_dir(old, 4) / "orchestrator" / "state.json").read_bytes()

    del written["prompts_per_env"], written["difficulty_pool"]
    (checkpoint_dir(old, 4) / "orchestrator" / "state.json").write_text(json.dumps(written, indent=2))
    Checkpointer(old, [feed([100], [8], seed=3)]).load(4)


def test_rl_resolves_the_newest_checkpoint_for_both_processes(tmp_path):
    for step in (2, 4):
        write_orchestrator_part(tmp_path, step)
        (checkpoint_dir(tmp_path, step) / "trainer").mkdir()
        (checkpoint_dir(tmp_path, step) / "trainer" / "STABLE").touch()
    (checkpoint_dir(tmp_path, 6) / "trainer").mkdir(parents=True)  # a killed writer's partial checkpoint
    config = resolve_shared(parse_config(RLConfig, ["--output-dir", str(tmp_path), "--ckpt.resume-step", "-1"]))
    assert complete_checkpoints(tmp_path) == [2, 4]
    assert resume_point(config) == 4
    assert config.trainer.ckpt.resume_step == config.orchestrator.ckpt.resume_step == 4

    missing = resolve_shared(parse_config(RLConfig, ["--output-dir", str(tmp_path), "--ckpt.resume-step", "3"]))
    with pytest.raises(TridentError, match=r"--ckpt.resume-step 3: .*complete checkpoints: steps \[2, 4\]"):
        resume_point(missing)


def test_resuming_keeps_the_metrics_of_earlier_steps(tmp_path):
    metrics = tmp_path / "metrics" / "trainer.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 6)))
    (tmp_path / "rollouts" / "step_4").mkdir(parents=True)
    clear_run_state(tmp_path, resume_from=3)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert not (tmp_path / "rollouts").exists()
    clear_run_state(tmp_path)
    assert not metrics.exists()


def test_a_stopped_run_resumes_with_the_difficulty_pool_exactly_as_saved(tmp_path, monkeypatch, on_weights_server):
    """A run with refill and a difficulty pool, dropped after the checkpoint of step 4 while step 5's groups run
    (nothing of it but its files survives), resumes from it with the pool it saved and draws the same tasks as an
    uninterrupted run from there on. (A real SIGKILL of a full run: tests/integration/test_rl.py.)"""
    steps = 6

    async def run_group(
        env, task, n, ctx, limits, output_dir
    ):  # tasks 0, 3, ... split their group; 1, 4, ... pass; 2, 5 fail
        rewards = [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]][int(task.data.id.split("-")[-1]) % 3]
        return group(rewards, ONE_SAMPLED, task=task.data.id)

    monkeypatch.setattr(groups_module, "run_group", run_group)

    def build(output_dir, resume_step=None):
        config = OrchestratorConfig(
            output_dir=output_dir, env=[{"id": "char-target", "args": {"num_examples": 30}}], batch_size=4,
            rollouts_per_example=3, max_steps=steps, async_level=1, sample_rollouts_every=0,
            filter={"refill": True, "max_attempts": 2}, difficulty_pool={"ema": 0.5},
            ckpt={"interval": 1, "keep": None, "resume_step": resume_step},
        )  # fmt: skip
        return on_weights_server(config)[0]

    whole = build(tmp_path / "whole")
    asyncio.run(run_steps(whole, steps))
    stopped = build(tmp_path / "stopped")
    asyncio.run(run_steps(stopped, steps, stop_at=4))
    saved = read_state(tmp_path / "stopped", 4)["difficulty_pool"]
    assert saved == read_state(tmp_path / "whole", 4)["difficulty_pool"]  # the same run up to the stop
    assert len(saved["pass_rates"][0]) > 4  # tasks seen and rated: the draws depend on them
    del stopped

    resumed = build(tmp_path / "stopped", resume_step=-1)
    asyncio.run(run_steps(resumed, steps))
    for step in range(5, steps + 1):  # the same tasks (and replacements) as the uninterrupted run drew
        assert batch_tasks(tmp_path / "stopped", step) == batch_tasks(tmp_path / "whole", step)
        # and, without the other run, each place's task is its own or a replacement the sampler draws with the pool
        # the checkpoint of the step before holds (what test_rl checks of its run's first resumed step)
        places = drawable_tasks(resumed.config, step, read_state(tmp_path / "stopped", step - 1)["difficulty_pool"])
        assert_drawn(batch_tasks(tmp_path / "stopped", step), places, rollouts=3)
    assert resumed.pool.state_dict() == whole.pool.state_dict()
    fresh = build(tmp_path / "fresh")  # an empty pool draws other tasks: the restore is what made them the same
    assert fresh.tasks.step_tasks(5).tasks != whole.tasks.step_tasks(5).tasks


def test_the_uninterrupted_draw_is_each_steps_slice_of_the_seeded_shuffle():
    """The reference resumed runs are checked against (tests/resumed_runs.py), against a naive computation: step N
    takes the N-th 4 of the 30 tasks shuffled with the seed, wrapping around (30 is not a multiple of 4)."""
    config = OrchestratorConfig(env=[{"id": "char-target", "args": {"num_examples": 30}}], batch_size=4, seed=5)
    order = list(range(30))
    random.Random(5).shuffle(order)
    expected = {
        step: [f"char-target-{order[i % 30]}" for i in range((step - 1) * 4, step * 4)] for step in range(1, 10)
    }
    assert uninterrupted_tasks(config, range(1, 10)) == expected
    with pytest.raises(ValueError, match="refill and the difficulty pool draw by the rewards"):
        uninterrupted_tasks(config.model_copy(update={"difficulty_pool": {"ema": 0.5}}), range(1, 2))


def test_a_stopped_run_resumes_drawing_each_step_the_tasks_its_config_gives(tmp_path, monkeypatch, on_weights_server):
    """A run stopped after the checkpoint of step 2 and resumed: each step's batch holds, for each rollout, the tasks
    the orchestrator's sampler gives that step from the run's config alone (tests/resumed_runs.py, no second run),
    those of the resumed steps included."""
    steps, rollouts = 5, 3

    async def run_group(env, task, n, ctx, limits, output_dir):
        return group([0.0, 1.0, 1.0], ONE_SAMPLED, task=task.data.id)

    monkeypatch.setattr(groups_module, "run_group", run_group)
    config = OrchestratorConfig(
        output_dir=tmp_path, env=[{"id": "char-target", "args": {"num_examples": 30}}], batch_size=4,
        rollouts_per_example=rollouts, max_steps=steps, async_level=1, sample_rollouts_every=0, seed=7,
        ckpt={"interval": 1, "keep": None},
    )  # fmt: skip
    asyncio.run(run_steps(on_weights_server(config)[0], steps, stop_at=2))
    resumed = config.model_copy(update={"ckpt": config.ckpt.model_copy(update={"resume_step": -1})})
    asyncio.run(run_steps(on_weights_server(resumed)[0], steps))
    for step, tasks in uninterrupted_tasks(config, range(1, steps + 1)).items():
        assert sorted(batch_tasks(tmp_path, step)) == sorted(tasks * rollouts), step


def test_the_reference_reads_the_config_rl_wrote_for_the_run(tmp_path):
    """``rl --dry-run`` of the debug run writes the orchestrator's resolved config; the reference drawn from it is
    the one drawn from the config rl resolved in memory."""
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--output-dir", str(tmp_path), "--dry-run"]))
    assert run(config) == 0
    assert run_config(tmp_path) == config.orchestrator
    assert uninterrupted_tasks(run_config(tmp_path), range(1, 3)) == uninterrupted_tasks(
        config.orchestrator, range(1, 3)
    )
