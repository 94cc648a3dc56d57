"""Trainer checkpoints: a resumed run continues exactly as if never stopped; writes are all-or-nothing."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from contracts.errors import TridentError
from contracts.run_dir import checkpoint_dir, complete_checkpoints, weights_dir
from orchestrator.ckpt import data_state, save_state
from trainer.ckpt import prune_checkpoints
from trainer.config import TrainerConfig
from trainer.train import train

SETTINGS = {"max_steps": 4, "optim": {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 1}, "batch_timeout_s": 1}


QLORA = {"experimental": {"load_in_4bit": True, "lora": {"rank": 4}}}


def config(output_dir, model_path, model=None, **ckpt) -> TrainerConfig:
    model = {"name": model_path, **(model or {})}
    return TrainerConfig(output_dir=output_dir, model=model, ckpt={"interval": 2, **ckpt}, **SETTINGS)


def losses(output_dir) -> dict[int, float]:
    lines = (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


@pytest.mark.parametrize(("model", "weights"), [({}, "model.safetensors"), (QLORA, "adapter_model.safetensors")],
                         ids=["full", "qlora"])  # fmt: skip
def test_resumed_run_matches_an_uninterrupted_one(tmp_path, write_batches, tiny_model_path, model, weights):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    write_batches(whole, steps=4)
    train(config(whole, tiny_model_path, model))

    write_batches(resumed, steps=2)  # the orchestrator "dies" after two batches: the trainer times out at step 3
    with pytest.raises(TimeoutError, match="rollouts/step_3"):
        train(config(resumed, tiny_model_path, model))
    assert complete_checkpoints(resumed) == []  # the orchestrator's part is missing: not resumable yet
    save_state(resumed, data_state(2, 8, 64, 0, [8]))
    assert complete_checkpoints(resumed) == [2]
    write_batches(resumed, steps=4)
    train(config(resumed, tiny_model_path, model, resume_step=-1))

    # model, AdamW moments, lr schedule and step counter all continue: same losses, same weights
    assert losses(resumed)[4] == pytest.approx(losses(whole)[4], rel=1e-6)
    assert losses(resumed)[3] == pytest.approx(losses(whole)[3], rel=1e-6)
    expected, got = (load_file(weights_dir(run, 4) / weights) for run in (whole, resumed))
    assert expected.keys() == got.keys()
    for name in expected:
        assert (expected[name] - got[name]).abs().max() < 1e-6, name


FULL_DISK_RUN = """
import json, sys
from pathlib import Path
from orchestrator.ckpt import data_state, save_state
from trainer.ckpt import CheckpointError
from trainer.config import TrainerConfig
from trainer.train import train

out, settings = Path(sys.argv[1]), json.loads(sys.argv[2])
save_state(out, data_state(2, 8, 64, 0, [8]))
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


def user_namespaces() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-rm", "true"]).returncode == 0


@pytest.mark.skipif(not user_namespaces(), reason="needs unprivileged user namespaces to mount a small tmpfs")
def test_a_full_disk_at_a_checkpoint_fails_in_one_line_and_the_run_resumes_exactly(
    tmp_path, write_batches, tiny_model_path
):
    whole, full = tmp_path / "whole", tmp_path / "full"
    write_batches(whole, steps=4)
    train(config(whole, tiny_model_path))
    write_batches(full, steps=4)
    disk = full / "checkpoints"
    disk.mkdir()
    settings = json.dumps({"output_dir": str(full), "model": {"name": tiny_model_path}, **SETTINGS})
    mount = f'mount -t tmpfs -o size=8m tmpfs {disk} && exec {sys.executable} -c "$0" {full} "$1"'
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, FULL_DISK_RUN, settings], capture_output=True, text=True, timeout=300
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
    assert losses(full)[3] == pytest.approx(losses(whole)[3], rel=1e-6)
    expected, got = (load_file(weights_dir(run, 4) / "model.safetensors") for run in (whole, full))
    for name in expected:
        assert (expected[name] - got[name]).abs().max() < 1e-6, name


def test_resume_without_a_checkpoint_says_what_exists(tmp_path, tiny_model_path):
    (checkpoint_dir(tmp_path, 3) / "trainer").mkdir(parents=True)  # partial: no STABLE, no orchestrator part
    with pytest.raises(
        TridentError, match=r"cannot resume from a checkpoint: .*checkpoints has no complete checkpoint"
    ):
        train(config(tmp_path, tiny_model_path, resume_step=-1))


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (2, 4, 6):
        for part in ("trainer", "orchestrator"):
            (checkpoint_dir(tmp_path, step) / part).mkdir(parents=True)
            (checkpoint_dir(tmp_path, step) / part / "STABLE").touch()
    (checkpoint_dir(tmp_path, 8) / "orchestrator").mkdir(parents=True)  # being written: newer, kept
    prune_checkpoints(tmp_path, keep=2)
    assert complete_checkpoints(tmp_path) == [4, 6]
    assert checkpoint_dir(tmp_path, 8).exists()
