import json

import pytest

from orchestrator.ckpt import check_resumable, data_state, save_state
from rl.config import parse_config
from rl.errors import TridentError
from rl.launch.launcher import resume_point
from rl.launch.rl_config import RLConfig, resolve_shared
from rl.protocol import checkpoint_dir, clear_run_state, complete_checkpoints


def test_orchestrator_part_records_the_data_position_atomically(tmp_path):
    folder = save_state(tmp_path, data_state(step=4, batch_size=8, num_tasks=100, seed=3, prompts_per_env=[6, 2]))
    assert folder == checkpoint_dir(tmp_path, 4) / "orchestrator"
    assert json.loads((folder / "state.json").read_text()) == {
        "step": 4, "tasks_consumed": 32, "num_tasks": 100, "seed": 3, "prompts_per_env": [6, 2]
    }  # fmt: skip
    assert (folder / "STABLE").exists()
    assert [p.name for p in folder.parent.iterdir()] == ["orchestrator"]  # no temporary folder left


def test_resume_refuses_a_changed_task_order(tmp_path):
    save_state(tmp_path, data_state(4, 8, 100, seed=3, prompts_per_env=[8]))
    check_resumable(tmp_path, data_state(4, 8, 100, seed=3, prompts_per_env=[8]))
    with pytest.raises(TridentError, match=r"task order changed \(num_tasks 100 -> 90, seed 3 -> 4\)"):
        check_resumable(tmp_path, data_state(4, 8, 90, seed=4, prompts_per_env=[8]))
    with pytest.raises(TridentError, match=r"task order changed \(prompts_per_env \[8\] -> \[6, 2\]\)"):
        check_resumable(tmp_path, data_state(4, 8, 100, seed=3, prompts_per_env=[6, 2]))


def test_rl_resolves_the_newest_checkpoint_for_both_processes(tmp_path):
    for step in (2, 4):
        save_state(tmp_path, data_state(step, 8, 100, 0, [8]))
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
    metrics.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(5)))
    (tmp_path / "rollouts" / "step_4").mkdir(parents=True)
    clear_run_state(tmp_path, resume_from=3)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2]
    assert not (tmp_path / "rollouts").exists()
    clear_run_state(tmp_path)
    assert not metrics.exists()
