"""Two multi-agent environments in one ``rl`` run on CPU with the tiny model, every seat on the run's own model
through Trident's client and the session's inference server: environments/digit_duel (two seats, zero-sum) and
environments/propose_solve (a proposer, here untrained, whose problem the solver seat answers ``SOLVERS`` times an
episode; its groups hold 3 rollouts an episode to the duel's 2). Every trained seat's trace is a sample with exact
masks (the loss-mask checker passes), baselines are per task × seat (read back from the batch files), and the
untrained seat gives no sample and no trainable token while its reward is logged. The proposer's and each seat's
masks when trained are checked without a server in tests/unit/orchestrator/test_propose_solve.py and test_seats.py."""

import json
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from contracts.metrics import read_metrics
from tools.rollout_check import check_step, open_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"
EPISODES = 4  # rollouts_per_example: episodes of each task, each giving one rollout per seat it plays
SOLVERS = 2  # solver runs per propose-solve episode
ENVS = [
    {"id": "digit-duel", "env_args": {"rounds": 1}},
    {"id": "propose-solve", "env_args": {"solvers": SOLVERS, "train_proposer": False}},
]


def multi_agent_run(output_dir: Path, server: str) -> tuple[list[dict], dict, object]:
    """One step of ``rl`` on both environments, 2 tasks of each × ``EPISODES`` episodes: the step's batch.json
    samples, the orchestrator's metrics and the loss-mask checker's report of the batch."""
    orch = output_dir.parent / f"{output_dir.name}-orch.toml"
    orch.write_text(f"batch_size = 4\nrollouts_per_example = {EPISODES}\nseq_len = 1024\n[model]\n"
                    'name = "trident/tiny-qwen3"\n[sampling]\nmax_tokens = 16\n')  # fmt: skip
    argv = [sys.executable, "-m", "launch.main", "--trainer", "@", str(DEBUG / "train.toml"),
            "--orchestrator", "@", str(orch), "--orchestrator.client.base-url", server, "--max-steps", "1",
            "--output-dir", str(output_dir), "--orchestrator.env", json.dumps(ENVS)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    report = check_step(*open_step(output_dir, None, None))  # the last step's batch, as check_loss_mask reads it
    assert [p for p in report.all_problems() if p.severity == "error"] == []
    batch = json.loads((output_dir / "rollouts" / "step_1" / "batch.json").read_text())
    return batch["samples"], read_metrics(output_dir, "orchestrator")[-1], report


def test_seats_of_two_environments_train_each_against_its_own_baseline_and_an_untrained_seat_gives_nothing(
    tmp_path, inference_server
):
    samples, metrics, report = multi_agent_run(tmp_path / "run", inference_server)
    by_baseline = defaultdict(list)
    for sample in samples:
        by_baseline[sample["env"], sample["task"], sample["seat"]].append(sample)
    sizes = {(env, seat): len(group) for (env, _, seat), group in by_baseline.items()}
    assert len(by_baseline) == 6  # 2 tasks × (player0, player1) + 2 tasks × solver; no proposer
    assert sizes == {("digit-duel", "player0"): EPISODES, ("digit-duel", "player1"): EPISODES,
                     ("propose-solve", "solver"): EPISODES * SOLVERS}  # fmt: skip
    for group in by_baseline.values():  # one sample per rollout: its advantage is its reward minus its seat's mean
        mean = statistics.fmean(s["reward"] for s in group)
        assert [s["advantage"] for s in group] == pytest.approx([s["reward"] - mean for s in group], abs=1e-6)
    for env, task, _ in by_baseline:  # zero-sum: each duel's two rewards cancel
        if env == "digit-duel":
            assert sum(s["reward"] for s in samples if s["task"] == task) == 0
    assert set(report.seat_counts()) == {"player0", "player1", "solver"}
    # the untrained proposer played every episode (its reward is logged) and sampled no trainable token
    assert metrics["seat/proposer/sampled_tokens"] == 0 and "seat/proposer/reward_mean" in metrics
    assert metrics["seat/solver/sampled_tokens"] == report.seat_counts()["solver"]["trainable"] > 0
    assert "env/propose-solve/seat/solver/reward_mean" in metrics
    assert (tmp_path / "run" / "plots" / "seats.png").is_file()  # the report's plot of each seat's reward
