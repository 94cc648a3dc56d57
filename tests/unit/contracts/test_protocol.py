import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import contracts.records
from contracts.atomic_io import atomic_dir, atomic_file, move_into_place, recover_aside
from contracts.errors import TridentError
from contracts.protocol import (
    CE_WEIGHTS_DTYPE,
    MICRO_BATCH_DTYPES,
    ROUTES_DTYPE,
    BatchInfo,
    MicroBatch,
    Sample,
    pack_samples,
    read_batch,
    repack,
    sample_summary,
    write_batch,
)
from contracts.run_dir import clear_run_state, latest_stable_weights, mark_stable, rollouts_dir, step_dirs, weights_dir


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
    with pytest.raises(ValueError, match="^a sample of 20 tokens does not fit in 12 tokens$"):
        pack_samples([sample(10, 10)], seq_len=12)
    assert [len(b) for b in pack_samples([sample(6, 6), sample(1, 1)], seq_len=12)] == [1, 1]  # 12 fit in 12


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


@pytest.fixture
def disk_events(monkeypatch):
    """The fsyncs (by path) and renames made, in order."""
    events = []
    real_fsync, real_rename, real_replace = os.fsync, Path.rename, Path.replace

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def rename(self, target):
        events.append(("rename", Path(self), Path(target)))
        return real_rename(self, target)

    def replace(self, target):
        events.append(("rename", Path(self), Path(target)))
        return real_replace(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(Path, "replace", replace)
    return events


def test_atomic_dir_puts_files_and_folders_on_the_disk_before_the_rename(tmp_path, disk_events):
    final = weights_dir(tmp_path, 1)
    with atomic_dir(final) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "model.bin").write_bytes(b"w")
        (tmp / "config.json").write_text("{}")
    rename = disk_events.index(("rename", tmp, final))
    synced = {event[1] for event in disk_events[:rename]}
    assert {tmp / "sub" / "model.bin", tmp / "config.json", tmp / "sub", tmp} <= synced
    assert ("fsync", final.parent) in disk_events[rename:]  # the rename itself is on the disk before it returns


def test_mark_stable_writes_the_marker_after_the_contents_are_on_the_disk(tmp_path, disk_events):
    (tmp_path / "model.bin").write_bytes(b"w")
    mark_stable(tmp_path)
    assert disk_events == [
        ("fsync", tmp_path / "model.bin"), ("fsync", tmp_path),
        ("fsync", tmp_path / "STABLE"), ("fsync", tmp_path),
    ]  # fmt: skip


def test_atomic_file_syncs_the_text_before_the_rename_and_the_folder_after(tmp_path, disk_events):
    path = tmp_path / "progress.json"
    atomic_file(path, "new")
    tmp = disk_events[0][1]
    assert disk_events == [("fsync", tmp), ("rename", tmp, path), ("fsync", tmp_path)]


def test_replacing_a_folder_renames_the_new_one_in_before_the_old_one_goes(tmp_path, disk_events):
    final = tmp_path / "step_1"
    with atomic_dir(final) as tmp:
        (tmp / "f").write_text("old")
    with atomic_dir(final) as tmp:
        (tmp / "f").write_text("new")
    renames = [event[1:] for event in disk_events if event[0] == "rename"]
    assert renames[-2:] == [(final, tmp_path / ".step_1.old"), (tmp, final)]
    assert (final / "f").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


class Crash(BaseException):
    """The host going down: nothing after it runs."""


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_a_crash_while_replacing_a_folder_leaves_the_old_or_the_new_one_whole(tmp_path, monkeypatch, crash_at):
    final, new = tmp_path / "step_1", tmp_path / ".step_1.tmp-x"
    for folder, text in ((final, "old"), (new, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    steps, real_rename, real_rmtree = [], Path.rename, shutil.rmtree

    def crash_at_step(real):
        def step(*args, **kwargs):
            steps.append(args[0])
            if len(steps) == crash_at:  # 1: renaming the old folder aside, 2: renaming the new one in, 3: deleting
                raise Crash
            return real(*args, **kwargs)

        return step

    monkeypatch.setattr(Path, "rename", crash_at_step(real_rename))
    monkeypatch.setattr(shutil, "rmtree", crash_at_step(real_rmtree))
    with pytest.raises(Crash):
        move_into_place(new, final)
    monkeypatch.undo()
    recover_aside(final)  # what the next write of the folder does first
    assert (final / "f").read_text() == ("old" if crash_at <= 2 else "new")
    assert not (tmp_path / ".step_1.old").exists()


def test_resume_drops_a_torn_last_line_and_keeps_the_steps_done(tmp_path, caplog):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    rows = "".join(json.dumps({"step": s, "completion": "x" * 1000}) + "\n" for s in range(1, 5))
    (metrics / "sample_rollouts.jsonl").write_text(rows + '{"step": 5, "completion": "xx')  # killed mid-line
    (metrics / "trainer.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    # evaluations name the weights step; the resumed run evaluates the weights it resumes from again
    (metrics / "eval.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    weights_dir(tmp_path, 4).mkdir(parents=True)
    with caplog.at_level(logging.WARNING, "contracts.records"):
        clear_run_state(tmp_path, resume_from=3)
    assert [r.getMessage() for r in caplog.records] == [
        f"dropped the torn last line of {metrics / 'sample_rollouts.jsonl'} (29 characters, no newline)"
    ]
    for name, kept in [("sample_rollouts", [1, 2, 3]), ("trainer", [1, 2, 3]), ("eval", [0, 1, 2])]:
        lines = (metrics / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == kept
    assert sorted(p.name for p in metrics.iterdir()) == ["eval.jsonl", "sample_rollouts.jsonl", "trainer.jsonl"]
    assert not (tmp_path / "weights").exists()


def test_resume_deletes_nothing_when_a_metrics_file_cannot_be_read(tmp_path):
    (tmp_path / "metrics" / "trainer.jsonl").mkdir(parents=True)  # not a file
    weights_dir(tmp_path, 4).mkdir(parents=True)
    with pytest.raises(TridentError, match=r"cannot read .*metrics/trainer.jsonl to resume: Is a directory"):
        clear_run_state(tmp_path, resume_from=3)
    assert weights_dir(tmp_path, 4).exists()


def test_a_bad_line_in_the_middle_is_skipped_and_reported_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(contracts.records, "_reported", set())
    path = tmp_path / "orchestrator.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n[3]\n{"step": 4')
    with caplog.at_level(logging.WARNING, "contracts.records"):
        # the last line is still being written
        assert contracts.records.read_records(path) == [{"step": 0}, {"step": 2}]
        assert contracts.records.read_records(path) == [{"step": 0}, {"step": 2}]
    assert [r.getMessage() for r in caplog.records] == [
        f"skipped line 2 of {path}: not a JSON object",
        f"skipped line 4 of {path}: not a JSON object",
    ]


def test_repack_fills_the_token_budget_and_keeps_each_sample_whole():
    lengths = [9, 7, 6, 5, 4, 3, 3, 2]  # 39 tokens, samples of at most seq_len = 10
    samples = [sample(n // 2, n - n // 2, advantage=float(i)) for i, n in enumerate(lengths)]
    by_seq_len = [MicroBatch.pack(b) for b in pack_samples(samples, seq_len=10)]
    repacked = repack(by_seq_len, tokens=20)
    assert all(len(m.input_ids) <= 20 for m in repacked)
    assert len(repacked) == 2  # 39 tokens in 20-token micro-batches: first fit, longest first fills [9, 7, 4], ...
    assert sorted(n for m in repacked for n in m.sample_lengths.tolist()) == sorted(lengths)
    # each sample's tokens, mask, advantage and logprobs travel together, positions restart per sample
    seen = set()
    for micro_batch in repacked:
        assert micro_batch.problem() is None
        for piece in micro_batch.samples():
            advantage = float(piece.advantages[0])
            original = samples[int(advantage)]
            assert piece.input_ids.tolist() == original.token_ids
            assert piece.loss_mask.tolist() == original.loss_mask
            assert piece.inference_logprobs.tolist() == pytest.approx(original.inference_logprobs)
            seen.add(advantage)
    assert len(seen) == len(samples)
    with pytest.raises(ValueError, match="does not fit"):
        repack(by_seq_len, tokens=8)  # a 9-token sample


def test_cross_entropy_weights_travel_only_where_some_sample_has_them(tmp_path):
    weighted = dataclasses.replace(sample(2, 0), ce_weights=[0.0, 0.5])
    micro_batches = [MicroBatch.pack([sample(2, 3)]), MicroBatch.pack([sample(1, 1), weighted])]
    assert micro_batches[0].ce_weights is None  # no sample has weights: no tensor, the file of before
    assert micro_batches[1].ce_weights.tolist() == [0.0, 0.0, 0.0, 0.5]  # 0 for the sample without
    info = BatchInfo(3, 3, 9, 4, 0.0, 1.0, num_ce_tokens=1)
    write_batch(tmp_path, info, micro_batches)
    read_info, read_micro_batches = read_batch(tmp_path, 3)
    assert read_info == info and read_micro_batches[0].ce_weights is None
    assert torch.equal(read_micro_batches[1].ce_weights, micro_batches[1].ce_weights)
    # split back into samples and joined again (the trainer's repacking), the weights stay with their tokens
    assert torch.equal(repack(read_micro_batches, 64)[0].ce_weights, torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 0.5]))
    assert repack(read_micro_batches[:1] * 2, 64)[0].ce_weights is None  # none where no row has them
    # batch.json names the count only when not 0, and the reader checks it against the files
    write_batch(tmp_path, BatchInfo(4, 1, 5, 3, 0.0, 1.0), micro_batches[:1])
    assert "num_ce_tokens" not in json.loads((rollouts_dir(tmp_path, 4) / "batch.json").read_text())
    write_batch(tmp_path, BatchInfo(5, 3, 9, 4, 0.0, 1.0, num_ce_tokens=2), micro_batches)
    with pytest.raises(TridentError, match="num_ce_tokens is 2, but the micro-batch files hold 1"):
        read_batch(tmp_path, 5)
    bad = dataclasses.replace(weighted, ce_weights=[0.0, -1.0])
    assert "negative" in MicroBatch.pack([bad]).problem()


def test_a_sample_whose_token_advantages_or_routes_do_not_fit_its_tokens_is_refused():
    def sample_with(**fields):
        return Sample([1, 2], [False, True], [0.0, -1.0], 0.0, 0.0, 0, **fields)

    routes = torch.zeros(2, 1, 2, dtype=torch.uint8)  # [tokens, layers, top_k]
    assert sample_with(token_advantages=[0.5, 1.0], routes=routes, ce_weights=[0.0, 1.0]).routes is routes
    for fields, message in [
        ({"token_advantages": [1.0, 1.0, 1.0]}, "3 token advantages for 2 tokens"),
        ({"ce_weights": [1.0]}, "1 cross-entropy weights for 2 tokens"),
        ({"routes": torch.zeros(2, 2, dtype=torch.uint8)}, r"routes of shape \[2, 2\] for 2 tokens"),
        ({"routes": torch.zeros(3, 1, 2, dtype=torch.uint8)}, r"routes of shape \[3, 1, 2\] for 2 tokens"),
    ]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            sample_with(**fields)


def test_pack_gives_each_tensor_its_file_dtype_whatever_numbers_the_sample_holds():
    """Python ints where floats are meant (an integer reward's advantage, a prompt's logprob 0) still make the
    dtypes the trainer's reader requires: a float advantage written as int64 would be refused as a bad file."""
    ints = Sample([3, 4, 5], [False, True, True], [0, -1, -2], advantage=1, reward=1, weight_step=2,
                  token_advantages=[1, 2, 3], ce_weights=[0, 1, 1])  # fmt: skip
    micro_batch = MicroBatch.pack([ints])
    assert {name: getattr(micro_batch, name).dtype for name in MICRO_BATCH_DTYPES} == MICRO_BATCH_DTYPES
    assert micro_batch.ce_weights.dtype == CE_WEIGHTS_DTYPE
    assert micro_batch.advantages.tolist() == [1.0, 2.0, 3.0] and micro_batch.weight_steps.tolist() == [2, 2, 2]
    assert micro_batch.problem() is None


def routed(first: int, n: int) -> Sample:
    """A sample of ``n`` tokens routed to 2 layers x top-2 experts (int64 ids, as a server's answer decodes)."""
    routes = torch.arange(first, first + 4 * n).reshape(n, 2, 2)
    return Sample(list(range(n)), [False] + [True] * (n - 1), [0.0] + [-1.0] * (n - 1), 1.0, 0.0, 0, routes=routes)


def test_routes_travel_with_their_tokens_through_the_file_splitting_and_repacking(tmp_path):
    a, b = routed(0, 3), routed(100, 2)
    micro_batch = MicroBatch.pack([b, a])
    assert micro_batch.routes.dtype == ROUTES_DTYPE
    assert micro_batch.routes.tolist() == [*b.routes.tolist(), *a.routes.tolist()]
    assert MicroBatch.pack([a, sample(1, 1)]).routes is None  # routing replay needs every token's routes
    write_batch(tmp_path, BatchInfo(1, 2, 5, 3, 0.0, 1.0), [micro_batch])
    (read,) = read_batch(tmp_path, 1)[1]
    assert torch.equal(read.routes, micro_batch.routes)
    assert [piece.routes.tolist() for piece in read.samples()] == [b.routes.tolist(), a.routes.tolist()]
    (repacked,) = repack([read], 8)  # longest first: a, then b
    assert repacked.routes.tolist() == [*a.routes.tolist(), *b.routes.tolist()]
    assert MicroBatch.concat([read, MicroBatch.pack([sample(1, 1)])]).routes is None


def test_sample_summary_records_the_advantage_reward_and_weight_step_beside_the_meta():
    s = dataclasses.replace(sample(1, 1, advantage=-0.5), reward=2.0, weight_step=3, meta={"env": "e", "task": 7})
    assert sample_summary(s) == {"advantage": -0.5, "reward": 2.0, "weight_step": 3, "env": "e", "task": 7}


def test_batch_json_is_written_one_key_a_line(tmp_path):
    """batch.json is read by people and by inspect tools too: indented one space, one field a line."""
    folder = write_batch(tmp_path, BatchInfo(3, 1, 2, 1, 0.25, 0.7, weight_steps=[2]), [])
    assert (folder / "batch.json").read_text().splitlines()[:3] == ["{", ' "step": 3,', ' "num_samples": 1,']


def test_micro_batches_are_read_back_in_the_order_written_past_ten(tmp_path):
    """micro_batch_10 comes after micro_batch_9, not after micro_batch_1; one-token samples are whole samples."""
    micro_batches = [MicroBatch.pack([Sample([i], [True], [-1.0], 0.0, 0.0, 0)]) for i in range(12)]
    write_batch(tmp_path, BatchInfo(1, 12, 12, 12, 0.0, 1.0), micro_batches)
    assert [m.input_ids.tolist() for m in read_batch(tmp_path, 1)[1]] == [[i] for i in range(12)]
