"""Benchmark: how long the inference server takes to start on CPU, and the CPU it spends, with vLLM's engine and
worker started by spawn (vLLM's way) and by fork (``inference.cpu_process_start``).

``uv run --no-sync python benchmarks/server_start.py`` (``--smoke``: one start of each).

The server of configs/debug/rl/infer.toml (the tiny model, no adapters) starts ``repeats`` times with each setting,
alternated so that a change in the machine's load hits both. Measured per start: seconds from the command to the
first healthy ``/health``, and the CPU seconds its process group had spent by then (the server, vLLM's engine and
worker, and multiprocessing's resource tracker, from ``/proc``); then it is stopped. The ratios spawn / fork of each
alternated pair, and their medians, are the saving.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import DEBUG_CONFIGS, benchmark_result, free_port, process_group_cpu_s, run_and_report, wait_healthy

from launch.process import Child, stop_all
from launch.supervise import child_env
from tools.tiny_model import built_model_path

REPEATS = 3
SETTINGS = ("spawn", "fork")


def start(setting: str, folder: Path) -> dict[str, float]:
    """Start the debug server with ``cpu_process_start = setting``: its seconds and CPU seconds to healthy."""
    port = free_port()
    argv = [sys.executable, "-m", "inference.main", "@", str(DEBUG_CONFIGS / "infer.toml"), "--port", str(port),
            "--cpu-process-start", setting]  # fmt: skip
    started = time.monotonic()
    server = Child("inference", argv, folder / f"{setting}-{port}.log", child_env({}))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        return {"ready_s": time.monotonic() - started, "cpu_s": process_group_cpu_s([server.popen.pid])}
    finally:
        stop_all([server])


def run(smoke: bool) -> dict:
    built_model_path("trident/tiny-qwen3")  # built before the first start, not during it
    repeats = 1 if smoke else REPEATS
    starts: dict[str, list[dict[str, float]]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="trident-server-start-") as tmp:
        for _ in range(repeats):
            for setting in SETTINGS:
                starts[setting].append(start(setting, Path(tmp)))
    medians = {
        setting: {key: statistics.median(s[key] for s in runs) for key in ("ready_s", "cpu_s")}
        for setting, runs in starts.items()
    }
    pairs = {
        key: [spawn[key] / fork[key] for spawn, fork in zip(starts["spawn"], starts["fork"], strict=True)]
        for key in ("ready_s", "cpu_s")
    }
    ratios = {key: statistics.median(each) for key, each in pairs.items()}
    return benchmark_result("server_start", repeats=repeats, starts=starts, medians=medians, spawn_over_fork=ratios,
                            pair_ratios=pairs)  # fmt: skip


def table(result: dict) -> str:
    lines = [f"{'setting':10}{'ready s':>10}{'CPU s':>10}   (medians of {result['repeats']})"]
    for setting, median in result["medians"].items():
        lines.append(f"{setting:10}{median['ready_s']:>10.1f}{median['cpu_s']:>10.1f}")
    ratios = result["spawn_over_fork"]
    lines.append(f"{'spawn/fork':10}{ratios['ready_s']:>10.2f}{ratios['cpu_s']:>10.2f}   (median of the pairs)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return run_and_report(argv, __doc__, "server_start", "one start of each setting", run, table)


if __name__ == "__main__":
    main()
