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

import pytest
import tomli_w
from procs import group_running, run_processes, wait_gone

from contracts.metrics import eval_line, read_metrics
from contracts.progress import read_progress
from contracts.protocol import complete_checkpoints
from orchestrator.ckpt import read_state

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"


def rl_argv(output_dir: Path, *flags: str, inference: bool = True) -> list[str]:
    """``rl`` on the debug configs; without ``inference`` it starts no server (give one with the flags)."""
    server = ["--inference", "@", str(DEBUG / "infer.toml")] if inference else []
    return [sys.executable, "-m", "launch.launcher", "--trainer", "@", str(DEBUG / "train.toml"),
            "--orchestrator", "@", str(DEBUG / "orch.toml"), *server,
            "--output-dir", str(output_dir), *flags]  # fmt: skip


def run_rl(output_dir: Path, *flags: str, timeout: float = 1500, inference: bool = True) -> subprocess.CompletedProcess:
    argv = rl_argv(output_dir, *flags, inference=inference)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def started_pids(output_dir: Path) -> dict[str, int]:
    path = output_dir / "logs" / "rl.log"
    log = path.read_text() if path.exists() else ""
    return {name: int(pid) for name, pid in re.findall(r"started (\w+) \(pid (\d+)\)", log)}


def assert_process_groups_gone(pids: dict[str, int], timeout_s: float = 30) -> None:
    """Each child led its own process group: nothing of it may keep running."""
    deadline = time.monotonic() + timeout_s
    for name, pid in pids.items():
        while group_running(pid):
            assert time.monotonic() < deadline, f"{name}'s process group {pid} is still running"
            time.sleep(0.5)


def test_debug_run_learns_and_cleans_up(tmp_path, inference_server):
    """The debug configs on the session's server (rl starting its own is the swe-grep test's and the two-server
    test's)."""
    result = run_rl(
        tmp_path, "--orchestrator.client.base-url", inference_server, "--progress-every-s", "0.2", inference=False
    )
    assert result.returncode == 0, result.stdout + result.stderr

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
    # 5-step means is over 5 standard errors
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
    # 64 rollouts each: a standard error of ~0.012 on the mean reward, ~0.017 on a difference
    assert evals[-1]["eval/char-target/reward_mean"] - evals[0]["eval/char-target/reward_mean"] > 0.05, evals
    assert all(e["eval/char-target/failed"] == 0 for e in evals)
    # `eval` alone on the run's last weights, with the run's [eval] as it is: the final scores, within noise
    rescored = standalone_eval(tmp_path, inference_server, tmp_path / "weights" / "step_20")
    assert abs(rescored["eval/char-target/reward_mean"] - evals[-1]["eval/char-target/reward_mean"]) < 0.06
    assert trainer[0]["mismatch_kl"] < 1e-6  # step 1: same weights, processed logprobs: ratio 1
    assert all(r["probe_gap"] < 1e-3 for r in orchestrator[2:])  # every reload served the trainer's weights
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 20 and summary["final"]["step"] == 20
    assert_process_groups_gone(started_pids(tmp_path))


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


def test_swe_grep_configs_run_on_cpu_with_the_tiny_model(tmp_path):
    """The single-GPU swe-grep configs, as they are, with only the model swapped: multi-turn tools, LoRA, full
    activation checkpointing, wandb offline; then the loss-mask checker passes on what the run wrote."""
    configs = ROOT / "configs" / "swe-grep" / "rl"
    argv = [sys.executable, "-m", "launch.launcher", "--trainer", "@", str(configs / "train.toml"),
            "--orchestrator", "@", str(configs / "orch.toml"), "--inference", "@", str(configs / "infer.toml"),
            "--model.name", "trident/tiny-qwen3", "--wandb.offline", "true", "--output-dir", str(tmp_path),
            "--inference.port", "8015"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [
        line.split(" |")[0] for line in result.stdout.splitlines() if line.startswith("step ") and " | " in line
    ] == [f"step {i}/5" for i in range(1, 6)]
    # the server takes well over 30 s to start: the user is told what the run waits for
    assert "waiting for step 1: starting the inference server" in result.stdout
    orchestrator = read_metrics(tmp_path, "orchestrator")
    assert len(orchestrator) == 5 and all(r["failed_rollouts"] == 0 for r in orchestrator)
    batch = json.loads((tmp_path / "rollouts" / "step_4" / "batch.json").read_text())
    assert {s["env"] for s in batch["samples"]} == {"swe-grep-oss-env"}
    assert "missed_files_penalty" in batch["samples"][0]["rewards"]
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # no API key here: offline either way
    assert len(runs) == 2 and all(b"reward_mean" in run.read_bytes() for run in runs)
    orchestrator_keys = (b"advantage_std", b"completion_len_mean", b"sampled_tokens_per_s", b"generate_s")
    assert any(all(key in run.read_bytes() for key in orchestrator_keys) for run in runs)
    # a table of sample rollouts every 10 steps from step 1: in the JSON lines and the orchestrator's W&B run
    rows = read_metrics(tmp_path, "sample_rollouts")
    assert rows and {r["step"] for r in rows} == {1} and {r["env"] for r in rows} == {"swe-grep-oss-env"}
    assert len(list(tmp_path.glob("wandb/offline-run-*/files/media/table/sample_rollouts_1_*.table.json"))) == 1
    check = subprocess.run(
        [sys.executable, "scripts/check_loss_mask.py", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "loss masks OK" in check.stdout
    # LoRA hot-swap: each step's adapter alone, swapped in under its own name, checked through the probe
    assert (tmp_path / "weights" / "step_5" / "adapter_config.json").exists()
    inference_log = (tmp_path / "logs" / "inference.log").read_text()
    swapped = [int(s) for s in re.findall(r"serving adapter lora-step-(\d+) of step", inference_log)]
    assert swapped == sorted({r["weight_step"] for r in orchestrator} - {0})
    assert all(r["probe_gap"] < 1e-3 for r in orchestrator[2:])


def test_failing_process_stops_the_run(tmp_path, inference_server):
    env = '[{"id": "reverse-text", "args": {"no_such_arg": 1}}]'  # installed, but it rejects the args at load
    server = ("--orchestrator.client.base-url", inference_server)
    result = run_rl(tmp_path, "--orchestrator.env", env, *server, timeout=300, inference=False)
    assert result.returncode == 1
    # the failure names the process, its exit code, its log, and shows the log's last lines
    assert f"orchestrator exited with code 1; last lines of {tmp_path / 'logs' / 'orchestrator.log'}" in result.stderr
    assert "environment 'reverse-text' rejects its args: no_such_arg" in result.stderr
    assert_process_groups_gone(started_pids(tmp_path))


def wait_for(condition, timeout_s: float, rl: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline and rl.poll() is None, f"rl: {what} did not happen"
        time.sleep(0.2)


def test_each_process_killed_at_a_random_step_and_the_run_resumes_exactly(tmp_path, inference_server):
    """SIGKILL the trainer, then the orchestrator, then inference, each at a random step: each time rl stops the
    whole run, and ``--ckpt.resume-step -1`` continues it from the newest complete checkpoint. In the end every
    step was trained once, on the prompts an uninterrupted run would have used. The run refills tied groups and
    draws its tasks from a difficulty pool (configs/debug/rl/filter.toml): each resume restores the pool saved.

    The first two runs use the session's server (no ``--inference``: rl starts none and the run resets the
    server to its base model); the third starts its own, to kill it."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    steps, batch_size = 8, 4
    # small steps (4 prompts x 2 rollouts): the test is about stopping and resuming
    flags = ["@", str(DEBUG / "filter.toml"), "--max-steps", str(steps), "--ckpt.interval", "2",
             "--orchestrator.batch-size", str(batch_size), "--orchestrator.rollouts-per-example", "2",
             "--no-orchestrator.eval"]  # fmt: skip
    running_server = ["--orchestrator.client.base-url", inference_server]
    own_server = ["--inference", "@", str(DEBUG / "infer.toml"), "--inference.port", "8013"]
    resumed_from = []
    for victim in ("trainer", "orchestrator", "inference"):
        resume = ["--ckpt.resume-step", "-1"] if resumed_from else []
        server = own_server if victim == "inference" else running_server
        argv = rl_argv(tmp_path, *flags, *server, *resume, inference=False)
        (tmp_path / "logs" / "rl.log").unlink(missing_ok=True)  # the pids of the run before
        rl = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            names = 3 if victim == "inference" else 2
            wait_for(lambda n=names: len(started_pids(tmp_path)) == n, 120, rl, "start its processes")
            pids = started_pids(tmp_path)
            if victim == "trainer":
                other = rl_argv(tmp_path, *flags, "--orchestrator.client.base-url", "http://x:1", inference=False)
                refused = subprocess.run(other, capture_output=True, text=True, timeout=120, cwd=ROOT)
                assert refused.returncode == 1
                assert f"another rl run (pid {rl.pid}) is using {tmp_path}" in refused.stderr
                # the refused run wrote nothing: the first run's processes still read their own configs
                assert inference_server in (tmp_path / "configs" / "orchestrator.toml").read_text()
            done = len(read_metrics(tmp_path, "trainer"))
            kill_after = max(done + rng.randint(1, 3), 3)  # a checkpoint (step 2) exists before the first kill
            trained = lambda n=kill_after: len(read_metrics(tmp_path, "trainer")) >= n  # noqa: E731
            wait_for(trained, 900, rl, f"{kill_after} trained steps")
            os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            _, stderr = rl.communicate(timeout=60)
            assert rl.returncode == 1, f"seed {seed}: {stderr}"
            assert time.monotonic() - killed_at < 30  # the stop grace is 10 s per process at most
            assert f"{victim} exited with code {-signal.SIGKILL}" in stderr
            assert_process_groups_gone(pids)
            assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
        finally:
            rl.kill()
        resumed_from.append(complete_checkpoints(tmp_path)[-1])

    pool = read_state(tmp_path, resumed_from[-1])["difficulty_pool"]  # what the last resume must start from
    resumed = subprocess.run(
        rl_argv(tmp_path, *flags, *running_server, "--ckpt.resume-step", "-1", inference=False),
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )  # fmt: skip
    assert resumed.returncode == 0, f"seed {seed}: {resumed.stdout + resumed.stderr}"
    last = resumed_from[-1]
    assert [
        line.split(" |")[0] for line in resumed.stdout.splitlines() if line.startswith("step ") and " | " in line
    ] == [f"step {i}/{steps}" for i in range(last + 1, steps + 1)], f"seed {seed}"
    # each step trained exactly once across the four runs, on the prompts an uninterrupted run would have used
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == list(range(1, steps + 1)), f"seed {seed}"
    assert [r["step"] for r in read_metrics(tmp_path, "orchestrator")] == list(range(1, steps + 1)), f"seed {seed}"
    orchestrator_log = (tmp_path / "logs" / "orchestrator.log").read_text()
    assert f"resuming after step {last}: prompts from task {last * batch_size} on" in orchestrator_log
    rated = sum(map(len, pool["pass_rates"]))
    assert rated > 0 and f"difficulty pool restored: pass rates of {rated} tasks" in orchestrator_log
    metrics = read_metrics(tmp_path, "orchestrator")
    assert all(r["refill/attempts_max"] <= 4 for r in metrics) and sum(r["refill/groups"] for r in metrics) > 0
    assert complete_checkpoints(tmp_path)[-1] == steps
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "finished"


def signal_run(rl: subprocess.Popen, output_dir: Path, *signals: signal.Signals, whole_group: bool = True) -> float:
    """Send ``signals`` to ``uv run rl``'s whole process group (as a scheduler or Ctrl-C does: uv forwards each, so
    rl gets it twice) or to rl alone; returns the seconds until no process of the run was left."""
    launcher = int((output_dir / "rl.lock").read_text())  # rl's pid, not uv's
    for sig in signals:
        os.killpg(rl.pid, sig) if whole_group else os.kill(launcher, sig)
        time.sleep(0.05)  # the second arrives while rl stops the processes
    gone = wait_gone(lambda: run_processes(launcher), timeout_s=30)
    rl.communicate(timeout=30)
    return gone


def test_signals_stop_every_process_of_the_run_and_it_resumes_exactly(tmp_path, inference_server):
    """Stopped as users and schedulers stop a run, through ``uv run``: SIGTERM to the whole process group while the
    server starts, during a step and during a checkpoint; Ctrl-C twice; SIGKILL of rl itself. Each time no process of
    the run is left 30 s later, and ``--ckpt.resume-step -1`` continues it: every step trained once, in order."""
    steps, batch_size = 8, 4
    # small steps (4 prompts x 2 rollouts): the test is about stopping and resuming
    flags = ["--max-steps", str(steps), "--ckpt.interval", "2", "--orchestrator.batch-size", str(batch_size),
             "--orchestrator.rollouts-per-example", "2", "--no-orchestrator.eval"]  # fmt: skip
    uv_rl = [shutil.which("uv"), "run", "--no-sync", "rl", *rl_argv(tmp_path, *flags, inference=False)[3:]]

    def start(*extra: str) -> subprocess.Popen:
        (tmp_path / "logs" / "rl.log").unlink(missing_ok=True)
        rl = subprocess.Popen([*uv_rl, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, start_new_session=True)  # fmt: skip
        wait_for(lambda: len(started_pids(tmp_path)) == (3 if "--inference" in extra else 2), 120, rl, "start")
        return rl

    def trained() -> int:
        return len(read_metrics(tmp_path, "trainer"))

    def status() -> str:
        return json.loads((tmp_path / "summary.json").read_text())["status"]

    # while its own server starts (no step yet, nothing to resume)
    rl = start("--inference", "@", str(DEBUG / "infer.toml"), "--inference.port", "8016")
    inference_log = tmp_path / "logs" / "inference.log"
    wait_for(lambda: inference_log.is_file() and inference_log.stat().st_size > 0, 120, rl, "the server's first log")
    signal_run(rl, tmp_path, signal.SIGTERM)
    assert status() == "interrupted" and trained() == 0
    inference_log = inference_log.read_text()
    assert "Application startup complete" not in inference_log  # it was still starting
    assert "rl (pid" not in inference_log  # rl stopped it, not its lifeline

    server = ["--orchestrator.client.base-url", inference_server]
    rl = start(*server)  # during a step
    wait_for(lambda: trained() >= 3, 600, rl, "3 trained steps")
    signal_run(rl, tmp_path, signal.SIGTERM, signal.SIGTERM)  # uv's forwarded copy may merge with the first
    assert status() == "interrupted"  # rl's exit; uv, signalled twice, may have exited before it
    rl_log = (tmp_path / "logs" / "rl.log").read_text()
    assert "SIGTERM: already stopping" in rl_log and "all processes stopped" in rl_log

    resume = [*server, "--ckpt.resume-step", "-1"]
    rl = start(*resume)  # during a checkpoint: as soon as the next one's folder appears
    next_ckpt = tmp_path / "checkpoints" / f"step_{complete_checkpoints(tmp_path)[-1] + 2}"
    wait_for(next_ckpt.exists, 600, rl, f"{next_ckpt} to appear")
    signal_run(rl, tmp_path, signal.SIGTERM)

    rl = start(*resume)  # Ctrl-C twice, mid-step
    done = trained()
    wait_for(lambda: trained() > done, 600, rl, "a step")
    signal_run(rl, tmp_path, signal.SIGINT, signal.SIGINT)
    assert status() == "interrupted"
    assert "SIGINT: already stopping" in (tmp_path / "logs" / "rl.log").read_text()

    rl = start(*resume)  # SIGKILL of rl alone: the processes stop themselves
    done = trained()
    wait_for(lambda: trained() > done, 600, rl, "a step")
    signal_run(rl, tmp_path, signal.SIGKILL, whole_group=False)
    assert "has exited: stopping process group" in (tmp_path / "logs" / "orchestrator.log").read_text()

    last = complete_checkpoints(tmp_path)[-1]
    resumed = subprocess.run([*uv_rl, *resume], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [
        line.split(" |")[0] for line in resumed.stdout.splitlines() if line.startswith("step ") and " | " in line
    ] == [f"step {i}/{steps}" for i in range(last + 1, steps + 1)]
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == list(range(1, steps + 1))
    assert [r["step"] for r in read_metrics(tmp_path, "orchestrator")] == list(range(1, steps + 1))
    orchestrator_log = (tmp_path / "logs" / "orchestrator.log").read_text()
    assert f"resuming after step {last}: prompts from task {last * batch_size} on" in orchestrator_log


def test_config_error_is_one_line_and_starts_nothing(tmp_path):
    result = run_rl(tmp_path, "--trainer.optim.lrr", "1", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --trainer.optim.lrr: trainer.optim.lrr: unknown key"
    assert not (tmp_path / "logs").exists()

    result = run_rl(tmp_path, "--orchestrator.env", '[{"id": "no-such-env"}]', timeout=120)
    assert result.returncode == 1 and "environment 'no-such-env' is not installed" in result.stderr
    assert not (tmp_path / "logs").exists()
