"""Reading the offline W&B runs a test's processes wrote."""

import time
from pathlib import Path

FINISHED = b"stream: all finished"  # wandb-core's last line for a run, once its .wandb file is written


def finished_run(run_dir: Path, timeout_s: float = 30.0) -> bytes:
    """The bytes of the ``.wandb`` file in ``run_dir`` (an ``offline-run-*`` folder), once W&B's service has
    finished writing it: ``run.finish()`` can return first, and the service process writes on."""
    log = run_dir / "logs" / "debug-internal.log"
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and FINISHED in log.read_bytes()):
        assert time.monotonic() < deadline, f"W&B did not finish writing {run_dir} in {timeout_s:.0f} s"
        time.sleep(0.1)
    (run_file,) = run_dir.glob("run-*.wandb")
    return run_file.read_bytes()


def finished_runs(folder: Path) -> list[bytes]:
    """:func:`finished_run` of every offline W&B run under ``folder/wandb``."""
    return [finished_run(run_dir) for run_dir in sorted((folder / "wandb").glob("offline-run-*"))]
