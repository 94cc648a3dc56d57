"""Full ``rl`` runs: the process boundary itself is what these tests prove."""

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import tomli_w
from procs import group_running, run_processes, wait_gone
from resumed_runs import assert_drawn, batch_tasks, drawable_tasks, run_config
from rl_runs import DEBUG, ROOT, rl_argv, started_pids, wait_for

from contracts.metrics import eval_line, read_metrics
from contracts.progress import read_progress
from contracts.run_dir import complete_checkpoints
from orchestrator.loop.ckpt import read_state
from tools.plots import load_runs, write_plots

pytestmark = pytest.mark.slow


def run_rl(
    output_dir: Path, *flags: str, timeout: float = 1500, inference: bool = True, plots: bool = False
) -> subprocess.CompletedProcess:
    argv = rl_argv(output_dir, *flags, inference=inference, plots=plots)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def assert_process_groups_gone(pids: dict[str, int], timeout_s: float = 30) -> None:
    """Each child led its own process group: nothing of it may keep running."""
    deadline = time.monotonic() + timeout_s
    for name, pid in pids.items():
        while group_running(pid):
            assert time.monotonic() < deadline, f"{name}'s process group {pid} is still running"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory, session_server) -> tuple[Path, subprocess.CompletedProcess]:
    """The debug configs run once on the session's server, drawing its plots, for the tests below to inspect: its
    output_dir and what rl printed (rl starting its own server is the swe-grep test's and the two-server test's)."""
    output_dir = tmp_path_factory.mktemp("debug-run")
    httpx.post(f"{session_server}/reset_weights", timeout=300).raise_for_status()  # a run refuses another's weights
    server = ("--orchestrator.client.base-url", session_server)
    result = run_rl(output_dir, *server, "--progress-every-s", "0.2", inference=False, plots=True)
    assert result.returncode == 0, result.stdout + result.stderr
    yield output_dir, result
    httpx.post(f"{session_server}/reset_weights", timeout=300).raise_for_status()


def test_debug_run_learns_and_cleans_up(debug_run):
    tmp_path, result = debug_run

    steps = [line for line in result.stdout.splitlines() if line.startswith("step ") and " | reward " in line]
    assert len(steps) == 20 and steps[-1].startswith("step 20/20 | reward")
    # a step running over 0.2 s (every step here: about 1 s each on a quiet machine, so a 1 s notice could miss
    # them all): what each process was doing, and for how long; all of it ended
    activity = r" · (orchestrator|trainer): [a-z].* \(\d+s\)"
    shown = [line for line in result.stdout.splitlines() if re.fullmatch(rf"step \d+/20 \(\d+s\)({activity})+", line)]
    assert shown, result.stdout
    assert read_progress(tmp_path) == []
    for name in ("rl", "orchestrator", "trainer"):
        assert (tmp_path / "logs" / f"{name}.log").stat().st_size > 0

    trainer = read_metrics(tmp_path, "trainer")
    orchestrator = read_metrics(tmp_path, "orchestrator")
    rewards = [r["reward_mean"] for r in orchestrator]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    # a step's reward mean has a standard error of ~0.012 (64 samples, std ~0.1): a gap of 0.05 between
    # 5-step means is over 5 standard errors. Sized from that, not from repeated runs: no repetition of this run's
    # rise is recorded (the nearest: the cp = 2 variant once, 0.27 -> 0.42, test_context_parallel_rl.py; QLoRA once,
    # 0.255 -> 0.721, docs/benchmarks.md)
    assert last - first > 0.05, rewards

    # rollouts of step N come from weights N - 2 (async_level 1; step 1 from the base model); the server loaded each
    assert [r["weight_step"] for r in orchestrator] == [0] + list(range(19))
    orchestrator_log = (tmp_path / "logs" / "orchestrator.log").read_text()
    reloaded = [int(s) for s in re.findall(r"server now serves weights step (\d+)", orchestrator_log)]
    assert reloaded == list(range(1, 19)) + [20]  # and the final weights, for their evaluation

    # held-out evaluation of the base model, mid-run and of the final weights, shown as it came; it learned too
    evals = read_metrics(tmp_path, "eval")
    assert [e["step"] for e in evals] == [0, 10, 20], evals
    assert [line for line in result.stdout.splitlines() if line.startswith("eval of weights step ")] == [
        eval_line(e) for e in evals
    ]
    # 64 rollouts each: a standard error of ~0.012 on the mean reward, ~0.017 on a difference (sized from that; no
    # repeated runs of the eval gain are recorded)
    assert evals[-1]["eval/char-target/reward_mean"] - evals[0]["eval/char-target/reward_mean"] > 0.05, evals
    assert all(e["eval/char-target/failed"] == 0 for e in evals)
    assert trainer[0]["mismatch_kl"] < 1e-6  # step 1: same weights, processed logprobs: ratio 1
    assert all(r["probe_gap"] < 1e-3 for r in orchestrator[2:])  # every reload served the trainer's weights
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 20 and summary["final"]["step"] == 20
    assert_process_groups_gone(started_pids(tmp_path))


def test_eval_alone_scores_the_runs_final_weights_as_the_run_did(debug_run, inference_server):
    """``eval`` alone on the run's last weights, with the run's [eval] as it is: the final scores, within noise."""
    run_dir, _ = debug_run
    rescored = standalone_eval(run_dir, inference_server, run_dir / "weights" / "step_20")
    final = read_metrics(run_dir, "eval")[-1]
    assert abs(rescored["eval/char-target/reward_mean"] - final["eval/char-target/reward_mean"]) < 0.06


def test_the_loss_mask_checker_passes_on_the_debug_run(debug_run):
    run_dir, _ = debug_run
    check = subprocess.run([sys.executable, "scripts/check_loss_mask.py", "--output-dir", str(run_dir)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert check.returncode == 0 and "loss masks OK" in check.stdout, check.stdout + check.stderr


def test_the_plots_of_the_debug_run_draw_its_metrics_at_their_steps(debug_run, tmp_path):
    """rl left its report and plots in the run; drawn again, each point is a step's metric at that step."""
    run_dir, _ = debug_run
    assert (run_dir / "plots" / "report.html").is_file() and (run_dir / "plots" / "reward.png").is_file()
    plots = {plot.name: plot for plot in write_plots(load_runs([run_dir]), tmp_path)}
    orchestrator, evals = read_metrics(run_dir, "orchestrator"), read_metrics(run_dir, "eval")
    assert list(plots["reward"].series.values()) == [
        ([r["step"] for r in orchestrator], [r["reward_mean"] for r in orchestrator])
    ]
    scores = ([e["step"] for e in evals], [e["eval/char-target/reward_mean"] for e in evals])
    assert scores in plots["eval"].series.values()


def standalone_eval(run_dir: Path, server_url: str, weights: Path) -> dict:
    """``eval`` on ``weights`` with the debug configs' [eval], against ``server_url``; its record of scores."""
    config = run_dir / "eval.toml"
    debug_eval = tomllib.loads((DEBUG / "orch.toml").read_text())["eval"]
    config.write_text(tomli_w.dumps({"weights": str(weights), "output_dir": str(run_dir / "eval"), "reset": True,
                                     "client": {"base_url": server_url}, "eval": debug_eval}))  # fmt: skip
    argv = [sys.executable, "-m", "orchestrator.eval_main", "@", str(config)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = read_metrics(run_dir / "eval", "eval")
    assert record["step"] == 20 and "eval of weights step 20 | char-target/reward_mean" in result.stderr
    return record


def test_failing_process_stops_the_run(tmp_path, inference_server):
    env = '[{"id": "reverse-text", "args": {"no_such_arg": 1}}]'  # installed, but it rejects the args at load
    server = ("--orchestrator.client.base-url", inference_server)
    result = run_rl(tmp_path, "--orchestrator.env", env, *server, timeout=300, inference=False)
    assert result.returncode == 1
    # the failure names the process, its exit code, the one line it gave and its log
    assert (
        "orchestrator exited with code 1: orchestrator failed: environment 'reverse-text' rejects its args: "
        "no_such_arg: Extra inputs are not permitted (its log: "
        f"{tmp_path / 'logs' / 'orchestrator.log'})"
    ) in result.stderr
    assert_process_groups_gone(started_pids(tmp_path))


def signal_run(rl: subprocess.Popen, output_dir: Path, *signals: signal.Signals) -> float:
    """Send ``signals`` to ``uv run rl``'s whole process group (as a scheduler or Ctrl-C does: uv forwards each, so
    rl gets it twice); returns the seconds until no process of the run was left."""
    launcher = int((output_dir / "rl.lock").read_text())  # rl's pid, not uv's
    for sig in signals:
        os.killpg(rl.pid, sig)
        time.sleep(0.05)  # the second arrives while rl stops the processes
    gone = wait_gone(lambda: run_processes(launcher, started_pids(output_dir).values()), timeout_s=30)
    rl.communicate(timeout=30)
    return gone


def test_a_run_killed_and_stopped_every_way_resumes_training_each_step_once(tmp_path, inference_server, free_port):
    """One run, stopped in turn as processes die and as users and schedulers stop runs, through ``uv run``: SIGTERM
    to the whole process group while its own server starts; SIGKILL of the trainer, of the orchestrator and of the
    inference server, each at a random step (each time rl stops the whole run, exits 1 naming the process, and
    leaves no process group behind); Ctrl-C then SIGTERM during a checkpoint, while the orchestrator generates the
    next step (SIGKILL of rl itself, whose processes stop themselves, is test_stream_run's stop). After each,
    ``--ckpt.resume-step -1`` continues from the newest complete checkpoint; in the end every step was trained once.
    The run refills tied groups and draws its tasks from a difficulty pool (configs/debug/rl/filter.toml), so its draws
    depend on the rewards: the first two steps after the last resume are checked against the places the
    orchestrator's sampler draws with the checkpoint's pool (computed here, no second run); for the later steps and
    the restored pool there are only the orchestrator's own log lines. That a resumed pool-and-refill run draws what
    an uninterrupted one does is test_orchestrator_ckpt.py's
    test_a_stopped_run_resumes_with_the_difficulty_pool_exactly_as_saved (the same Orchestrator.step, a fake group
    runner). The session's server serves it, but for the stages that start their own."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    steps, batch_size = 16, 4
    # small steps (4 prompts x 2 rollouts): the test is about stopping and resuming
    flags = ["@", str(DEBUG / "filter.toml"), "--max-steps", str(steps), "--ckpt.interval", "2",
             "--orchestrator.batch-size", str(batch_size), "--orchestrator.rollouts-per-example", "2",
             "--no-orchestrator.eval", "--trainer.keep-rollouts", str(steps)]  # fmt: skip
    uv_rl = [shutil.which("uv"), "run", "--no-sync", "rl", *rl_argv(tmp_path, *flags, inference=False)[3:]]
    session_server = ["--orchestrator.client.base-url", inference_server]
    own_server = ["--inference", "@", str(DEBUG / "infer.toml"), "--inference.port", str(free_port())]
    resume = ["--ckpt.resume-step", "-1"]

    def start(*extra: str) -> subprocess.Popen:
        (tmp_path / "logs" / "rl.log").unlink(missing_ok=True)  # the pids of the run before
        rl = subprocess.Popen([*uv_rl, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, start_new_session=True)  # fmt: skip
        wait_for(lambda: len(started_pids(tmp_path)) == (3 if "--inference" in extra else 2), 120, rl, "start")
        return rl

    def trained() -> int:
        return len(read_metrics(tmp_path, "trainer"))

    def status() -> str:
        return json.loads((tmp_path / "summary.json").read_text())["status"]

    def kill(victim: str, rl: subprocess.Popen) -> None:
        """SIGKILL ``victim`` 1-3 steps on (after step 3 at the earliest, so a checkpoint exists): rl stops it all."""
        pids = started_pids(tmp_path)
        kill_after = max(trained() + rng.randint(1, 3), 3)
        wait_for(lambda: trained() >= kill_after, 900, rl, f"{kill_after} trained steps")
        os.kill(pids[victim], signal.SIGKILL)
        _, stderr = rl.communicate(timeout=120)  # only against a hang: rl stops the rest within its 10 s grace
        assert rl.returncode == 1, f"seed {seed}: {stderr}"
        assert f"{victim} exited with code {-signal.SIGKILL}" in stderr
        assert "all processes stopped" in (tmp_path / "logs" / "rl.log").read_text()  # rl stopped the others
        assert_process_groups_gone(pids)
        assert status() == "failed"

    # SIGTERM while its own server starts (no step yet, nothing to resume)
    rl = start(*own_server)
    inference_log = tmp_path / "logs" / "inference.log"
    wait_for(lambda: inference_log.is_file() and inference_log.stat().st_size > 0, 120, rl, "the server's first log")
    signal_run(rl, tmp_path, signal.SIGTERM)
    assert status() == "interrupted" and trained() == 0
    inference_log = inference_log.read_text()
    assert "Application startup complete" not in inference_log  # it was still starting
    assert "rl (pid" not in inference_log  # rl stopped it, not its lifeline

    rl = start(*session_server)  # SIGKILL of the trainer; meanwhile a second rl on the run's folder is refused
    refused = subprocess.run([*uv_rl, "--orchestrator.client.base-url", "http://x:1"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)  # fmt: skip
    launcher = int((tmp_path / "rl.lock").read_text())
    assert refused.returncode == 1 and f"another rl run (pid {launcher}) is using {tmp_path}" in refused.stderr
    # the refused run wrote nothing: the first run's processes still read their own configs
    assert inference_server in (tmp_path / "configs" / "orchestrator.toml").read_text()
    kill("trainer", rl)

    kill("orchestrator", start(*session_server, *resume))

    rl = start(*session_server, *resume)  # Ctrl-C, then SIGTERM, as soon as the next checkpoint's folder appears
    next_ckpt = tmp_path / "checkpoints" / f"step_{complete_checkpoints(tmp_path)[-1] + 2}"
    wait_for(next_ckpt.exists, 600, rl, f"{next_ckpt} to appear")
    signal_run(rl, tmp_path, signal.SIGINT, signal.SIGTERM)  # uv forwards each: rl gets them twice, may merge them
    assert status() == "interrupted"  # rl's exit; uv, signalled twice, may have exited before it
    rl_log = (tmp_path / "logs" / "rl.log").read_text()
    assert "SIGTERM: already stopping" in rl_log and "all processes stopped" in rl_log

    kill("inference", start(*own_server, *resume))  # the run's own server (the session's serves other tests)

    last = complete_checkpoints(tmp_path)[-1]
    pool = read_state(tmp_path, last)["difficulty_pool"]  # what the last resume must start from
    # its first two steps' places, as an uninterrupted run draws them: a step's pool weights count the results of the
    # steps before the one before it, so the checkpoint's pool fixes both
    places = {
        step: drawable_tasks(run_config(tmp_path), step, pool) for step in range(last + 1, min(last + 2, steps) + 1)
    }
    resumed = subprocess.run([*uv_rl, *session_server, *resume], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert resumed.returncode == 0, f"seed {seed}: {resumed.stdout + resumed.stderr}"
    assert [
        line.split(" |")[0] for line in resumed.stdout.splitlines() if line.startswith("step ") and " | " in line
    ] == [f"step {i}/{steps}" for i in range(last + 1, steps + 1)], f"seed {seed}"
    # each step trained exactly once across the runs; the orchestrator says it went on after the checkpoint's step
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == list(range(1, steps + 1)), f"seed {seed}"
    assert [r["step"] for r in read_metrics(tmp_path, "orchestrator")] == list(range(1, steps + 1)), f"seed {seed}"
    orchestrator_log = (tmp_path / "logs" / "orchestrator.log").read_text()
    assert f"resuming after step {last}: prompts from task {last * batch_size} on" in orchestrator_log
    # the first resumed steps' batches: each place's task is its own or one of its refill replacements, drawn by the
    # orchestrator's sampler with the checkpoint's pool in this process (catches a resume one step late; an
    # unrestored pool where its draw differs: test_orchestrator_ckpt's pool test holds the whole run)
    for step, drawable in places.items():
        assert_drawn(batch_tasks(tmp_path, step), drawable, rollouts=2)
    rated = sum(map(len, pool["pass_rates"]))
    assert f"difficulty pool restored: pass rates of {rated} tasks" in orchestrator_log
    # a step's results count from two steps on: checkpoint 2 (the stops' random steps can leave it the newest) may
    # hold none yet, its steps pending (CI of 42d4003 resumed from it last: "pass rates of 0 tasks")
    assert rated > 0 or (last <= 2 and pool["pending"]), pool
    metrics = read_metrics(tmp_path, "orchestrator")
    assert all(r["refill/attempts_max"] <= 4 for r in metrics) and sum(r["refill/groups"] for r in metrics) > 0
    assert complete_checkpoints(tmp_path)[-1] == steps
    assert status() == "finished" and not (tmp_path / "plots").exists()  # --no-plots (the debug run draws them)


def test_config_error_is_one_line_and_starts_nothing(tmp_path):
    result = run_rl(tmp_path, "--trainer.optim.lrr", "1", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --trainer.optim.lrr: trainer.optim.lrr: unknown key"
    assert not (tmp_path / "logs").exists()

    result = run_rl(tmp_path, "--orchestrator.env", '[{"id": "no-such-env"}]', timeout=120)
    assert result.returncode == 1 and "environment 'no-such-env' is not installed" in result.stderr
    assert not (tmp_path / "logs").exists()
