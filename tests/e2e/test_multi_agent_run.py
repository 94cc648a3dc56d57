"""A two-seat self-play environment through ``rl`` on CPU with the tiny model: environments/digit_duel, both seats
on the run's own model through Trident's client and the session's inference server. Every seat's trace is a sample
with exact masks (the loss-mask checker passes) and baselines are per task × seat (read back from the batch files).
A seat the environment does not train gives no sample: tests/unit/orchestrator/test_seats.py, without a server."""

import json
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tools.rollout_check import check_step, open_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"
EPISODES = 4  # rollouts_per_example: episodes of each task, each giving one rollout per seat


def duel_run(output_dir: Path, server: str, steps: int) -> list[list[dict]]:
    """``rl`` on digit-duel for ``steps`` steps of 2 tasks × ``EPISODES`` episodes; each step's batch.json samples."""
    orch = output_dir.parent / f"{output_dir.name}-orch.toml"
    orch.write_text(f"batch_size = 2\nrollouts_per_example = {EPISODES}\nseq_len = 1024\n[model]\n"
                    'name = "trident/tiny-qwen3"\n[sampling]\nmax_tokens = 16\n')  # fmt: skip
    env = [{"id": "digit-duel", "env_args": {"rounds": 1}}]
    argv = [sys.executable, "-m", "launch.launcher", "--trainer", "@", str(DEBUG / "train.toml"),
            "--orchestrator", "@", str(orch), "--orchestrator.client.base-url", server, "--max-steps", str(steps),
            "--output-dir", str(output_dir), "--orchestrator.env", json.dumps(env)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    report = check_step(*open_step(output_dir, None, None))  # the last step's batch, as check_loss_mask reads it
    assert [p for p in report.all_problems() if p.severity == "error"] == []
    batches = [output_dir / "rollouts" / f"step_{step}" / "batch.json" for step in range(1, steps + 1)]
    return [json.loads(batch.read_text())["samples"] for batch in batches]


def test_both_seats_train_each_against_its_own_baseline(tmp_path, inference_server):
    (samples,) = duel_run(tmp_path / "both", inference_server, steps=1)
    by_baseline = defaultdict(list)
    for sample in samples:
        by_baseline[sample["task"], sample["seat"]].append(sample)
    assert {seat for _, seat in by_baseline} == {"player0", "player1"}
    assert len(by_baseline) == 4 and all(len(group) == EPISODES for group in by_baseline.values())
    for group in by_baseline.values():  # one sample per rollout: its advantage is its reward minus its seat's mean
        mean = statistics.fmean(s["reward"] for s in group)
        assert [s["advantage"] for s in group] == pytest.approx([s["reward"] - mean for s in group], abs=1e-6)
    for task in {task for task, _ in by_baseline}:  # zero-sum: each episode's two rewards cancel
        assert sum(s["reward"] for s in samples if s["task"] == task) == 0

