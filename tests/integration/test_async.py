"""async_level bounds how stale the weights behind each batch may be (trainer and orchestrator against the
session's server; the trainer exports LoRA adapters, so the server's base weights stay as other tests expect)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"
STEPS = 4


@pytest.mark.parametrize("async_level", [0, 2])
def test_async_level_bounds_the_staleness_of_every_batch(tmp_path, inference_server, async_level):
    shared = ["--output-dir", str(tmp_path), "--max-steps", str(STEPS)]
    trainer = [sys.executable, "-m", "trainer.main", "@", str(DEBUG / "train.toml"), *shared,
               "--model.experimental.lora.rank", "8"]  # fmt: skip
    orchestrator = [sys.executable, "-m", "orchestrator.main", "@", str(DEBUG / "orch.toml"), *shared,
                    "--async-level", str(async_level), "--client.base-url", inference_server,
                    "--batch-size", "2", "--rollouts-per-example", "4", "--overlap-tail", "1"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for argv in (trainer, orchestrator)]  # fmt: skip
    for process in processes:
        output, _ = process.communicate(timeout=900)
        assert process.returncode == 0, output[-3000:]

    weight_steps = [record["weight_step"] for record in read_metrics(tmp_path, "orchestrator")]
    assert len(weight_steps) == STEPS
    for step, weight_step in enumerate(weight_steps, start=1):
        assert step - 1 - async_level <= weight_step <= step - 1, weight_steps
        batch = json.loads((tmp_path / "rollouts" / f"step_{step}" / "batch.json").read_text())
        assert {sample["weight_step"] for sample in batch["samples"]} == {weight_step}
    if async_level == 0:
        assert weight_steps == list(range(STEPS))  # on-policy: each batch from the weights just trained
    staleness = [record["staleness"] for record in read_metrics(tmp_path, "orchestrator")]
    assert staleness == [step - 1 - weight_step for step, weight_step in enumerate(weight_steps, start=1)]
    started_early = [record["started_early_s"] for record in read_metrics(tmp_path, "orchestrator")]
    if async_level == 0:
        assert started_early == [0.0] * STEPS  # each step needs the one before trained: nothing overlaps
    else:
        # step 2 may use the base weights and starts with step 1 (overlap_tail 1): it ran beside step 1
        assert started_early[1] > 0, started_early
