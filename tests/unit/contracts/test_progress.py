"""progress/<process>.json: what each process is doing now. What ``rl`` prints from it while a step runs long, with
real processes writing it, is checked in tests/integration/test_progress_cli.py."""

import time

import pytest

from contracts.progress import Progress, read_progress
from contracts.run_dir import clear_run_state


def test_activities_are_written_as_they_begin_count_and_end(tmp_path, monkeypatch):
    trainer = Progress(tmp_path, "trainer")
    orchestrator = Progress(tmp_path, "orchestrator")
    assert read_progress(tmp_path) == []
    with trainer.doing("writing checkpoint step 4"):
        sampling = orchestrator.begin("sampling step 5", total=3, unit="groups")
        now = time.time()
        assert [a.describe(now) for a in read_progress(tmp_path)] == [
            "trainer: writing checkpoint step 4 (0s)",  # the longest-running first
            "orchestrator: sampling step 5, 0/3 groups done (0s)",
        ]
        monkeypatch.setattr("contracts.progress.COUNT_WRITE_S", 0.0)
        orchestrator.advance(sampling)
        assert read_progress(tmp_path)[1].done == 1
        monkeypatch.setattr("contracts.progress.COUNT_WRITE_S", 3600.0)
        orchestrator.advance(sampling)  # a count moving fast is written at most every COUNT_WRITE_S
        assert read_progress(tmp_path)[1].done == 1
        orchestrator.advance(sampling)  # its last part ends it
    assert read_progress(tmp_path) == []
    with pytest.raises(RuntimeError), trainer.doing("training step 5"):
        raise RuntimeError  # a failure ends the activity too
    assert read_progress(tmp_path) == []


def test_only_the_first_rank_writes_and_a_new_run_starts_without_the_last_ones(tmp_path):
    Progress(None, "trainer").begin("training step 1")  # another rank: nothing on disk
    assert not (tmp_path / "progress").exists()
    Progress(tmp_path, "trainer").begin("training step 1")  # then killed: it never ends
    assert len(read_progress(tmp_path)) == 1
    assert tmp_path / "progress" in clear_run_state(tmp_path)
    assert read_progress(tmp_path) == []
