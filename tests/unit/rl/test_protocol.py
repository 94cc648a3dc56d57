import pytest
import torch

from rl.protocol import (
    BatchInfo,
    MicroBatch,
    Sample,
    atomic_dir,
    atomic_file,
    clear_run_state,
    latest_stable_weights,
    mark_stable,
    pack_samples,
    read_batch,
    rollouts_dir,
    step_dirs,
    weights_dir,
    write_batch,
)


def sample(n_prompt, n_completion, advantage=1.0):
    return Sample(
        token_ids=list(range(n_prompt + n_completion)),
        loss_mask=[False] * n_prompt + [True] * n_completion,
        inference_logprobs=[0.0] * n_prompt + [-0.5] * n_completion,
        advantage=advantage,
        reward=0.0,
        weight_step=0,
    )


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        Sample([1, 2], [True], [0.0, 0.0], 0.0, 0.0, 0)


def test_pack_respects_seq_len_and_keeps_every_sample():
    samples = [sample(3, 4), sample(2, 2), sample(5, 5), sample(1, 1)]
    bins = pack_samples(samples, seq_len=12)
    assert all(sum(len(s.token_ids) for s in b) <= 12 for b in bins)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in samples)
    assert len(bins) == 2
    with pytest.raises(ValueError, match="does not fit"):
        pack_samples([sample(10, 10)], seq_len=12)


def test_micro_batch_positions_restart_per_sample():
    micro_batch = MicroBatch.pack([sample(2, 1, advantage=0.5), sample(1, 2, advantage=-1.0)])
    assert micro_batch.position_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert micro_batch.loss_mask.tolist() == [False, False, True, False, True, True]
    assert micro_batch.advantages.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0, -1.0]
    assert micro_batch.sample_lengths.tolist() == [3, 3]


def test_batch_round_trip(tmp_path):
    micro_batches = [MicroBatch.pack([sample(2, 3)]), MicroBatch.pack([sample(1, 1), sample(4, 2)])]
    info = BatchInfo(
        step=3, num_samples=3, num_tokens=13, num_loss_tokens=6, reward_mean=0.25, temperature=0.7, weight_steps=[2]
    )
    write_batch(tmp_path, info, micro_batches)
    read_info, read_micro_batches = read_batch(tmp_path, 3)
    assert read_info == info
    for written, read in zip(micro_batches, read_micro_batches, strict=True):
        for key, value in written.to_dict().items():
            assert torch.equal(getattr(read, key), value), key
    assert [p.name for p in rollouts_dir(tmp_path, 3).parent.iterdir()] == ["step_3"]


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    final = rollouts_dir(tmp_path, 0)
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("killed mid-write")
    assert not final.exists()
    assert list(final.parent.iterdir()) == []


def test_atomic_dir_keeps_a_folder_another_writer_finished(tmp_path):
    final = tmp_path / "model"
    with atomic_dir(final, replace=False) as tmp:
        (tmp / "mine").write_text("x")
        final.mkdir()
        (final / "theirs").write_text("y")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in final.iterdir()] == ["theirs"]


def test_atomic_file_replaces_whole(tmp_path):
    path = tmp_path / "progress" / "trainer.json"
    atomic_file(path, "old")
    atomic_file(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["trainer.json"]


def test_step_dirs_in_step_order(tmp_path):
    for name in ("step_10", "step_2", "step_x", ".step_3.tmp-1", "other"):
        (tmp_path / name).mkdir()
    assert step_dirs(tmp_path) == {2: tmp_path / "step_2", 10: tmp_path / "step_10"}
    assert list(step_dirs(tmp_path)) == [2, 10]
    assert step_dirs(tmp_path / "missing") == {}


def test_latest_stable_weights_ignores_unfinished(tmp_path):
    assert latest_stable_weights(tmp_path) == 0
    for step in (1, 2, 3):
        weights_dir(tmp_path, step).mkdir(parents=True)
    mark_stable(weights_dir(tmp_path, 1))
    mark_stable(weights_dir(tmp_path, 2))
    assert latest_stable_weights(tmp_path) == 2


def test_clear_run_state_keeps_checkpoints(tmp_path):
    for name in ("rollouts/step_0", "weights/step_1", "metrics", "checkpoints/step_1", "logs"):
        (tmp_path / name).mkdir(parents=True)
    deleted = clear_run_state(tmp_path)
    assert sorted(p.name for p in deleted) == ["metrics", "rollouts", "weights"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "logs"]
