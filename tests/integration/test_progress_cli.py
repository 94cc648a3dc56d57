"""What ``rl`` prints from progress/<process>.json while a step runs long: two processes of their own write progress
as the trainer and the orchestrator do, and ``rl``'s supervisor shows each activity. How progress is written and read
is checked in tests/unit/contracts/test_progress.py."""

import os
import sys
import textwrap
from pathlib import Path

from launch.launcher import supervise
from launch.process import Child
from launch.rl_config import RLConfig, resolve_shared
from launch.supervise import WaitNotice

FAKE_PROCESS = """
import json, os, sys, time
from contracts.progress import Progress
output_dir, name = sys.argv[1], sys.argv[2]
progress = Progress(output_dir, name)

def until_shown(what):  # rl showed a line with what this process does now (the test marks it)
    while not os.path.exists(f"{output_dir}/shown-{what}"):
        time.sleep(0.05)

if name == "trainer":
    with progress.doing("writing checkpoint step 1"):
        until_shown("checkpoint")
    with open(f"{output_dir}/metrics/trainer.jsonl", "a") as f:
        step = {"step": 1, "reward_mean": 0.5, "loss": 0.1, "tokens": 10, "wait_s": 1.0, "train_s": 0.5, "save_s": 0.1}
        f.write(json.dumps(step) + "\\n")
    with progress.doing("training step 2"):
        until_shown("step-2")
else:
    evaluation = progress.begin("evaluating weights step 0", total=4, unit="groups")
    until_shown("evaluation")
    time.sleep(max(0.0, evaluation.since + 1.1 - time.time()))
    progress.advance(evaluation)  # written: the count was last written over a second ago
    until_shown("step-2")
"""

# what rl shows -> the event it releases in the fake processes
SHOWN = {
    "· trainer: writing checkpoint step 1 (": "checkpoint",
    "· orchestrator: evaluating weights step 0, 0/4 groups done (": "evaluation",
}


def test_rl_prints_what_each_process_does_while_a_step_runs_long(tmp_path, capsys, monkeypatch):
    """Two processes that write progress as the trainer and the orchestrator do, each holding an activity until rl
    has shown it; without a terminal, rl prints their activities every progress_every_s while a step runs longer
    than that."""
    (tmp_path / "metrics").mkdir()
    script = tmp_path / "fake_process.py"
    script.write_text(textwrap.dedent(FAKE_PROCESS))
    show = WaitNotice.show

    def show_and_release(notice: WaitNotice, text: str) -> None:
        show(notice, text)
        released = [event for marker, event in SHOWN.items() if marker in text]
        step_2 = "· trainer: training step 2 (" in text and "· orchestrator: evaluating weights step 0, 1/4" in text
        for event in released + (["step-2"] if text.startswith("step 2/2 (") and step_2 else []):
            (tmp_path / f"shown-{event}").touch()

    monkeypatch.setattr(WaitNotice, "show", show_and_release)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    children = {
        name: Child(name, [sys.executable, str(script), str(tmp_path), name], tmp_path / f"{name}.log", env)
        for name in ("trainer", "orchestrator")
    }
    config = resolve_shared(RLConfig(output_dir=tmp_path, max_steps=2, progress_every_s=1.0))
    assert supervise(children, config) == 0  # each process ended: every line it waited for was shown
    lines = capsys.readouterr().out.splitlines()
    waiting = [line for line in lines if line.startswith("waiting for step 1: ")]
    assert any("· trainer: writing checkpoint step 1 (" in line for line in waiting), lines
    assert any("· orchestrator: evaluating weights step 0, 0/4 groups done (" in line for line in waiting), lines
    assert any(line.startswith("step 1/2 | reward 0.5000") for line in lines)
    second = [line for line in lines if line.startswith("step 2/2 (")]
    assert any("· trainer: training step 2 (" in line for line in second), lines
    # its count moved once more than a second after it was last written
    assert any("· orchestrator: evaluating weights step 0, 1/4 groups done (" in line for line in second), lines
