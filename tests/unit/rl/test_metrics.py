from rl.config import parse_config
from rl.metrics import MetricsWriter, read_metrics
from rl.rl_config import RLConfig, resolve_shared
from rl.shared_config import WandbConfig


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
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert b"mismatch_kl" in data and b"run-trainer" in data
