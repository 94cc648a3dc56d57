"""Full ``rl`` runs of the CPU debug configs, for the tests that prove the process boundary."""

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
DEBUG = ROOT / "configs" / "debug" / "rl"


def rl_argv(output_dir: Path, *flags: str, inference: bool = True, plots: bool = False) -> list[str]:
    """``rl`` on the debug configs; without ``inference`` it starts no server (give one with the flags); without
    ``plots`` a finished run draws no plots (``--no-plots``: about 10 s saved, for the tests that do not read them)."""
    server = ["--inference", "@", str(DEBUG / "infer.toml")] if inference else []
    return [sys.executable, "-m", "launch.main", "--trainer", "@", str(DEBUG / "train.toml"),
            "--orchestrator", "@", str(DEBUG / "orch.toml"), *server, *([] if plots else ["--no-plots"]),
            "--output-dir", str(output_dir), *flags]  # fmt: skip


def wait_for(condition, timeout_s: float, rl: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline and rl.poll() is None, f"rl: {what} did not happen"
        time.sleep(0.2)


def started_pids(output_dir: Path) -> dict[str, int]:
    """The pid of each process the run in ``output_dir`` started, by name, from its ``rl.log``."""
    path = output_dir / "logs" / "rl.log"
    log = path.read_text() if path.exists() else ""
    return {name: int(pid) for name, pid in re.findall(r"started (\w+) \(pid (\d+)\)", log)}
