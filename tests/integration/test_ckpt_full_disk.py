"""Trainer checkpoints on a full disk: a real 8 MiB tmpfs under ``checkpoints/``, mounted in a user namespace for a
trainer run in a process of its own; the failed write is one line, leaves the older checkpoint whole, and the run
resumes exactly as if never stopped. The other checkpoint tests are in tests/unit/trainer/test_ckpt.py."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from batches import write_random_batches
from namespaces import user_namespaces
from safetensors.torch import load_file
from trainer_runs import SETTINGS, config, losses

from contracts.run_dir import weights_dir
from trainer.train import train

FULL_DISK_RUN = """
import json, sys
from pathlib import Path
from trainer_runs import write_orchestrator_part
from trainer.ckpt import CheckpointError
from trainer.config import TrainerConfig
from trainer.train import train

out, settings = Path(sys.argv[1]), json.loads(sys.argv[2])
write_orchestrator_part(out, 2)
filler = out / "checkpoints" / "filler"
filler.write_bytes(bytes(3 * 2**20))  # the 8 MiB disk holds the checkpoint of step 2, not that of step 4 too
results = {}
try:
    train(TrainerConfig(**settings, ckpt={"interval": 2}))
except CheckpointError as e:
    results["error"] = str(e)
results["left"] = sorted(str(p.relative_to(out / "checkpoints")) for p in (out / "checkpoints").rglob("*"))
filler.unlink()  # the operator frees space and resumes
train(TrainerConfig(**settings, ckpt={"interval": 2, "resume_step": -1}))
results["resumed"] = sorted(str(p.relative_to(out / "checkpoints")) for p in (out / "checkpoints").rglob("STABLE"))
print(json.dumps(results))
"""


@pytest.mark.skipif(not user_namespaces(), reason="needs unprivileged user namespaces to mount a small tmpfs")
def test_a_full_disk_at_a_checkpoint_fails_in_one_line_and_the_run_resumes_exactly(tmp_path, tiny_model_path):
    whole, full = tmp_path / "whole", tmp_path / "full"
    write_random_batches(whole, steps=4)
    train(config(whole, tiny_model_path))
    write_random_batches(full, steps=4)
    disk = full / "checkpoints"
    disk.mkdir()
    settings = json.dumps({"output_dir": str(full), "model": {"name": tiny_model_path}, **SETTINGS})
    mount = f'mount -t tmpfs -o size=8m tmpfs {disk} && exec {sys.executable} -c "$0" {full} "$1"'
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, FULL_DISK_RUN, settings],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])},  # tests/, for trainer_runs
    )
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout.splitlines()[-1])

    error = results["error"]  # dcp raised its CheckpointException, not an OSError
    assert "\n" not in error and "Traceback" not in error
    assert re.fullmatch(
        rf"could not write checkpoint {disk}/step_4/trainer: no space left on the disk \([\d.]+ MiB free\); nothing "
        r"of it was kept and older checkpoints are intact \(free space, then resume with --ckpt.resume-step -1\)",
        error,
    ), error
    assert [p for p in results["left"] if "step_4" in p] == ["step_4"]  # no .trainer.tmp, no partial part
    assert "step_2/trainer/STABLE" in results["left"] and "step_2/trainer/__0_0.distcp" in results["left"]
    assert "step_4/trainer/STABLE" in results["resumed"]
    # resumed from step 2 after the failure: the same losses and weights as a run never stopped
    for step in (3, 4):  # the steps trained after the resume
        assert losses(full)[step] == pytest.approx(losses(whole)[step], rel=1e-6), step
    expected, got = (load_file(weights_dir(run, 4) / "model.safetensors") for run in (whole, full))
    for name in expected:
        assert (expected[name] - got[name]).abs().max() < 1e-6, name
