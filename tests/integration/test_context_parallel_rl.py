"""The debug run with each micro-batch's tokens split over two trainer ranks (configs/debug/cp: cp = 2, gloo) learns
through ``rl`` on the session's server: rl starts two trainer ranks, step 1's logprobs equal the server's (the split
model scores every token as the server sampled it), every reload serves the trainer's weights, and the reward rises as
the debug run's does. The split's exactness against cp = 1: tests/integration/test_context_parallel_two_ranks.py."""

import statistics
import subprocess

import httpx
from rl_runs import ROOT, rl_argv

from contracts.metrics import read_metrics

CP = ROOT / "configs" / "debug" / "cp" / "train.toml"


def test_the_debug_run_split_over_two_trainer_ranks_learns_through_rl(tmp_path, session_server):
    httpx.post(f"{session_server}/reset_weights", timeout=300).raise_for_status()  # a run refuses another's weights
    argv = rl_argv(tmp_path, "--trainer", "@", str(CP), "--orchestrator.client.base-url", session_server,
                   "--no-orchestrator.eval", inference=False)  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    httpx.post(f"{session_server}/reset_weights", timeout=300).raise_for_status()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "training trident/tiny-qwen3 on 2 × cpu" in (tmp_path / "logs" / "trainer.log").read_text()

    trainer, orchestrator = read_metrics(tmp_path, "trainer"), read_metrics(tmp_path, "orchestrator")
    assert [record["step"] for record in trainer] == list(range(1, 21))
    assert trainer[0]["mismatch_kl"] < 1e-6  # step 1: the server's weights, scored on two ranks: ratio 1
    assert all(record["probe_gap"] < 1e-3 for record in orchestrator[2:])  # every reload served the trainer's weights
    rewards = [record["reward_mean"] for record in orchestrator]
    # as the debug run's test (test_rl.py): a step's mean reward has a standard error of ~0.012, so a rise of 0.05
    # between the first and last 5 steps' means is over 5 standard errors (one run by hand: 0.27 -> 0.42, +0.15; no
    # more repetitions recorded, so no spread)
    assert statistics.mean(rewards[-5:]) - statistics.mean(rewards[:5]) > 0.05, rewards
