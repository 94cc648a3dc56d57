"""Child processes of ``rl``: started in their own process group, logged to a file, stopped as a tree."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import preloaded

# The module each process of a run runs (``python -m``)
MODULES = {"inference": "inference.main", "orchestrator": "orchestrator.main", "trainer": "trainer.main"}


def command(module: str, config_path: Path, nproc: int = 1) -> list[str]:
    """``python -m <module> @ <config>``, under ``torchrun`` with ``nproc`` processes when there are several."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *launcher, "-m", module, "@", str(config_path)]


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """``argv`` with the environment overrides before it, as a shell would run them."""
    return shlex.join([f"{key}={value}" for key, value in env.items()] + argv)


class Child:
    """One supervised process (see :func:`command`) whose output goes to ``log_path``."""

    lost: str | None = None  # a local child always exits by itself (a Ray child's actor may die: launch.ray_actor)

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.popen = preloaded.start(argv, log_path, env)  # forked by the preloaded starter, where there is one
        if self.popen is not None:
            return
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: stop() reaches its children too
            )

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        self.popen.poll()  # reap the leader once it exits, so that only the rest of its group counts
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        return True


def stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM every child's process group at once, then SIGKILL whatever is left after ``grace_s``."""
    for child in children:
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(child.group_alive() for child in children):
        time.sleep(0.1)
    for child in children:
        child.signal_group(signal.SIGKILL)
        child.popen.wait()
