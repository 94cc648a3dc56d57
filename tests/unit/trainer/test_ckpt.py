"""Trainer checkpoints: a resumed run continues exactly as if never stopped; writes are all-or-nothing."""

import errno
import json

import pytest
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from orchestrator.ckpt import data_state, save_state
from rl.errors import TridentError
from rl.protocol import checkpoint_dir, complete_checkpoints, weights_dir
from trainer.ckpt import CheckpointError, prune_checkpoints
from trainer.config import TrainerConfig
from trainer.train import train

SETTINGS = {"max_steps": 4, "optim": {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 1}, "batch_timeout_s": 1}


def config(output_dir, model_path, **ckpt) -> TrainerConfig:
    return TrainerConfig(output_dir=output_dir, model={"name": model_path}, ckpt={"interval": 2, **ckpt}, **SETTINGS)


def losses(output_dir) -> dict[int, float]:
    lines = (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def test_resumed_run_matches_an_uninterrupted_one(tmp_path, write_batches, tiny_model_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    write_batches(whole, steps=4)
    train(config(whole, tiny_model_path))

    write_batches(resumed, steps=2)  # the orchestrator "dies" after two batches: the trainer times out at step 2
    with pytest.raises(TimeoutError, match="rollouts/step_2"):
        train(config(resumed, tiny_model_path))
    assert complete_checkpoints(resumed) == []  # the orchestrator's part is missing: not resumable yet
    save_state(resumed, data_state(2, 8, 64, 0, [8]))
    assert complete_checkpoints(resumed) == [2]
    write_batches(resumed, steps=4)
    train(config(resumed, tiny_model_path, resume_step=-1))

    # model, AdamW moments, lr schedule and step counter all continue: same losses, same weights
    assert losses(resumed)[3] == pytest.approx(losses(whole)[3], rel=1e-6)
    assert losses(resumed)[2] == pytest.approx(losses(whole)[2], rel=1e-6)
    expected, got = (load_file(weights_dir(run, 4) / "model.safetensors") for run in (whole, resumed))
    for name in expected:
        assert (expected[name] - got[name]).abs().max() < 1e-6, name


def test_disk_full_keeps_the_previous_checkpoint(tmp_path, write_batches, tiny_model_path, monkeypatch):
    write_batches(tmp_path, steps=4)
    real_save = dcp.save
    calls = []

    def save(state, checkpoint_id):
        calls.append(checkpoint_id)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", save)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step_4/trainer: .*No space left"):
        train(config(tmp_path, tiny_model_path))
    assert (checkpoint_dir(tmp_path, 2) / "trainer" / "STABLE").exists()
    assert [p.name for p in checkpoint_dir(tmp_path, 4).iterdir()] == []  # no partial part left behind


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
