"""Trainer checkpoints: a resumed run continues exactly as if never stopped; writes are all-or-nothing. A disk that
fills up at a checkpoint (a real tmpfs, in a process of its own) is checked in
tests/integration/test_ckpt_full_disk.py."""

import pytest
from safetensors.torch import load_file
from trainer_runs import config, losses, write_orchestrator_part

from contracts.errors import TridentError
from contracts.metrics import read_metrics
from contracts.run_dir import checkpoint_dir, complete_checkpoints, weights_dir
from trainer.ckpt import Checkpointer, prune_checkpoints
from trainer.train import train

QLORA = {"experimental": {"load_in_4bit": True, "lora": {"rank": 4}}}


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
    write_orchestrator_part(resumed, 2)
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


def test_a_kill_right_after_a_checkpoint_keeps_the_steps_metrics(tmp_path, write_batches, tiny_model_path, monkeypatch):
    """The step's metrics are written before its checkpoint: a run stopped just after the checkpoint of step 2 (as
    SIGTERM during a checkpoint can) and resumed from it has every step's record once (step 2's went missing)."""
    write_batches(tmp_path, steps=4)
    write_orchestrator_part(tmp_path, 2)  # the orchestrator's part of step 2's checkpoint
    save = Checkpointer.save

    def stop_after(checkpointer, step):
        save(checkpointer, step)
        raise SystemExit("stopped")

    monkeypatch.setattr(Checkpointer, "save", stop_after)
    with pytest.raises(SystemExit):
        train(config(tmp_path, tiny_model_path))
    monkeypatch.undo()
    train(config(tmp_path, tiny_model_path, resume_step=-1))
    assert [record["step"] for record in read_metrics(tmp_path, "trainer")] == [1, 2, 3, 4]


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
