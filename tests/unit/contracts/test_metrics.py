import json

from wandb_runs import finished_runs

from contracts.config import parse_config
from contracts.metrics import MetricsWriter, read_metrics, write_summary
from contracts.records import append_records
from contracts.shared_config import WandbConfig
from launch.launcher import step_line
from launch.rl_config import RLConfig, resolve_shared


def test_wandb_offline_flag_reaches_trainer_and_orchestrator():
    config = resolve_shared(parse_config(RLConfig, ["--wandb.offline", "true", "--wandb.project", "p"]))
    assert config.trainer.wandb == config.orchestrator.wandb == WandbConfig(project="p", offline=True)
    bare = resolve_shared(parse_config(RLConfig, ["--wandb.offline"]))
    assert bare.trainer.wandb.offline and bare.orchestrator.wandb.offline
    assert resolve_shared(parse_config(RLConfig, [])).trainer.wandb is None  # off unless asked for


def test_metrics_go_to_jsonl_and_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: offline even without offline = true
    writer = MetricsWriter(tmp_path, "trainer", WandbConfig(name="run"))
    for step in range(2):
        writer.write({"step": step, "loss": 0.5 - step, "mismatch_kl": 1e-7})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == [0, 1]
    (data,) = finished_runs(tmp_path)
    assert b"mismatch_kl" in data and b"run-trainer" in data


def test_tables_go_to_jsonl_and_a_wandb_table(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    writer = MetricsWriter(tmp_path, "orchestrator", WandbConfig(offline=True))
    rows = [{"step": 0, "prompt": "abc", "reward": 1.0}, {"step": 0, "prompt": "def", "reward": 0.0}]
    writer.write({"step": 0, "reward_mean": 0.5})
    writer.write_table("sample_rollouts", 0, rows)
    writer.write_table("sample_rollouts", 1, [])  # nothing to show: nothing logged
    writer.close()
    assert read_metrics(tmp_path, "sample_rollouts") == rows
    (table_file,) = tmp_path.glob("wandb/offline-run-*/files/media/table/sample_rollouts_0_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "reward"] and table["data"] == [[0, "abc", 1.0], [0, "def", 0.0]]


def test_step_line_is_compact_and_adds_the_orchestrators_truncation_when_known():
    """The trailing time is the step's own (the trainer's wait for its batch, training, writing weights), labelled,
    not the time since the previous line (0.0s when the launcher found two steps' records at once)."""
    trainer = {"step": 3, "reward_mean": 0.27821, "loss": 0.0008, "tokens": 5134, "wait_s": 1.2, "train_s": 0.3,
               "save_s": 0.14}  # fmt: skip
    line = step_line(trainer, {"step": 3, "truncated_rate": 0.04}, max_steps=20)
    time = "step time 1.6s (1.2s waiting for rollouts)"
    assert line == f"step 3/20 | reward 0.2782 | loss +0.0008 | tokens 5134 | truncated 4% | {time}"
    assert step_line(trainer, None, 20) == f"step 3/20 | reward 0.2782 | loss +0.0008 | tokens 5134 | {time}"


def test_summary_has_final_and_best_metrics_of_both_processes(tmp_path):
    trainer, orchestrator = MetricsWriter(tmp_path, "trainer"), MetricsWriter(tmp_path, "orchestrator")
    for step, reward in enumerate([0.2, 0.5, 0.4]):
        orchestrator.write({"step": step, "reward_mean": reward, "truncated_rate": 0.1})
        trainer.write({"step": step, "reward_mean": reward, "loss": -step})
    orchestrator.write({"step": 3, "reward_mean": 0.9})  # sampled, never trained: not part of the summary
    summary = json.loads(write_summary(tmp_path, "finished", 12.34).read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3 and summary["wall_s"] == 12.3
    assert summary["final"] == {"step": 2, "reward_mean": 0.4, "truncated_rate": 0.1, "loss": -2}
    assert summary["best_reward"] == {"step": 1, "reward_mean": 0.5}


def test_appending_after_a_torn_line_keeps_the_new_record_whole(tmp_path):
    path = tmp_path / "metrics" / "trainer.jsonl"
    path.parent.mkdir()
    path.write_text('{"step": 0}\n{"step": 1, "lo')  # the writer was killed mid-line
    append_records(path, [{"step": 1}, {"step": 2}])
    assert read_metrics(tmp_path, "trainer") == [{"step": 0}, {"step": 1}, {"step": 2}]
