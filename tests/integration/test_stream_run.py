"""The CPU debug run on an endless generated taskset (configs/debug/rl/stream.toml: puzzle-stream with refill) through
``rl``, killed mid-run and resumed: every step draws the tasks an uninterrupted run draws, and the orchestrator's
memory stays flat."""

import os
import re
import signal
import subprocess

import pytest
from procs import run_processes, wait_gone
from resumed_runs import assert_drawn, batch_tasks, drawable_tasks, run_config
from rl_runs import DEBUG, ROOT, rl_argv, started_pids, wait_for

from contracts.metrics import read_metrics
from contracts.run_dir import complete_checkpoints

pytestmark = pytest.mark.slow

STEPS, PROMPTS, ATTEMPTS = 20, 4, 2  # ATTEMPTS: stream.toml's [filter] max_attempts
KILL_AFTER = 9  # trained steps: the newest complete checkpoint is step 8's (interval 2), or a later one


def test_a_killed_stream_run_resumes_drawing_what_an_uninterrupted_run_draws_with_flat_memory(
    tmp_path, inference_server
):
    """20 small steps (4 prompts x 2 rollouts, a replacement for each tied group), a checkpoint every 2; ``rl``
    SIGKILLed after step 9 (its processes stop themselves), then resumed from its newest checkpoint."""
    flags = ["@", str(DEBUG / "stream.toml"), "--max-steps", str(STEPS), "--ckpt.interval", "2",
             "--orchestrator.batch-size", str(PROMPTS), "--orchestrator.rollouts-per-example", "2",
             "--no-orchestrator.eval", "--trainer.keep-rollouts", str(STEPS),
             "--orchestrator.client.base-url", inference_server]  # fmt: skip
    argv = rl_argv(tmp_path, *flags, inference=False)
    rl = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: len(read_metrics(tmp_path, "trainer")) >= KILL_AFTER, 900, rl, f"{KILL_AFTER} steps")
        launcher = int((tmp_path / "rl.lock").read_text())
        os.kill(launcher, signal.SIGKILL)
        wait_gone(lambda: run_processes(launcher, started_pids(tmp_path).values()), timeout_s=30)
    finally:
        if rl.poll() is None:
            os.killpg(rl.pid, signal.SIGKILL)
        rl.communicate()
    last = complete_checkpoints(tmp_path)[-1]
    assert KILL_AFTER - 1 <= last < STEPS
    tasks = {step: batch_tasks(tmp_path, step) for step in range(1, last + 1)}  # rl deletes them when it resumes
    killed_log = tmp_path / "logs" / "orchestrator.log"
    assert "has exited: stopping process group" in killed_log.read_text()  # the processes stopped themselves
    killed_log.unlink()

    resumed = subprocess.run([*argv, "--ckpt.resume-step", "-1"], capture_output=True, text=True, timeout=900,
                             cwd=ROOT)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not (tmp_path / "plots").exists()  # finished under --no-plots (rl_argv's): no plots drawn
    log = (tmp_path / "logs" / "orchestrator.log").read_text()
    position = last * PROMPTS * ATTEMPTS  # where step last + 1's window begins
    assert f"resuming after step {last}" in log
    assert re.findall(r"reading its task stream up to task (\d+), where the resumed run", log) == [str(position)]

    trainer, orchestrator = read_metrics(tmp_path, "trainer"), read_metrics(tmp_path, "orchestrator")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))  # each step trained once
    assert [r["step"] for r in orchestrator] == list(range(1, STEPS + 1))
    tasks |= {step: batch_tasks(tmp_path, step) for step in range(last + 1, STEPS + 1)}
    config = run_config(tmp_path)
    for step, drawn in tasks.items():
        # each task in the batch fills one place (a group of 2 rollouts, one sample each) with its own task or its one
        # refill replacement, as the orchestrator's sampler draws them for an uninterrupted run of the run's config
        assert_drawn(drawn, drawable_tasks(config, step), rollouts=2)

    # memory: the stream holds at most the next step's window (and the one after it while steps overlap); the
    # orchestrator's resident memory after each step of the resumed run stays within 128 MiB of its second step's
    assert all(r["stream_tasks_held"] <= 2 * PROMPTS * ATTEMPTS for r in orchestrator)
    resident = [r["resident_gib"] for r in orchestrator[last + 1 :]]
    assert max(resident) - resident[0] < 0.125, resident
