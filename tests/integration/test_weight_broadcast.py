"""In-memory weights (``[weight_broadcast]``): trainer and orchestrator against the session's server; the server
gets every step's full weights over the trainer's process group (gloo on CPU) or from a shared buffer in /dev/shm
(``backend = "shared"``, as ``rl`` picks for a trainer and a server on one device), never from files, and serves
exactly them (the probe)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.metrics import read_metrics
from contracts.weight_manifest import read_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"
STEPS = 3


@pytest.mark.parametrize("backend", ["gloo", "shared"])
def test_every_step_reaches_the_server_in_memory(tmp_path, inference_server, broadcast_port, backend):
    shared = ["--output-dir", str(tmp_path), "--max-steps", str(STEPS)]
    trainer = [sys.executable, "-m", "trainer.main", "@", str(DEBUG / "train.toml"), *shared,
               "--weight-broadcast.port", str(broadcast_port), "--weight-broadcast.backend", backend]  # fmt: skip
    orchestrator = [sys.executable, "-m", "orchestrator.main", "@", str(DEBUG / "orch.toml"), *shared,
                    "--client.base-url", inference_server, "--async-level", "0", "--no-eval",
                    "--batch-size", "2", "--rollouts-per-example", "4"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for argv in (trainer, orchestrator)]  # fmt: skip
    outputs = []
    for process in processes:
        output, _ = process.communicate(timeout=900)
        outputs.append(output)
        assert process.returncode == 0, output[-3000:]

    # on-policy: batches 1 and 2 were sampled from weights 1 and 2, each received over the broadcast
    orchestrator_records = read_metrics(tmp_path, "orchestrator")
    assert [r["weight_step"] for r in orchestrator_records] == [0, 1, 2]
    assert all(r["probe_gap"] < 1e-3 for r in orchestrator_records[1:])  # the server serves the trainer's weights
    served = [int(step) for step in re.findall(r"server now serves weights step (\d+)", outputs[1])]
    assert served == [1, 2]
    # what the server received had no weight files: a manifest; the last weights, which no one samples from,
    # are the run's model on disk
    for step in served:
        folder = tmp_path / "weights" / f"step_{step}"
        assert read_manifest(folder)["backend"] == backend and not list(folder.glob("*.safetensors"))
    assert list((tmp_path / "weights" / f"step_{STEPS}").glob("*.safetensors"))
    if backend == "shared":  # the buffer's file went once the server had mapped it
        assert not Path(read_manifest(folder)["buffer"]["path"]).exists()
