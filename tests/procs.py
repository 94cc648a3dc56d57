"""What is still running: process groups, and the processes an ``rl`` run started (read from ``/proc``)."""

import time
from collections.abc import Iterable
from pathlib import Path

from contracts.lifeline import LAUNCHER_PID_ENV, marked


def _running(pid_dir: Path) -> tuple[str, int] | None:
    """A process's state and group, or None once it is gone (or a zombie, waiting for its parent to reap it)."""
    try:
        state, _, group = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[:3]
    except (OSError, IndexError):
        return None
    return None if state == "Z" else (state, int(group))


def alive(pid: int) -> bool:
    """Whether process ``pid`` is still running."""
    return _running(Path(f"/proc/{pid}")) is not None


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running."""
    return any((found := _running(d)) and found[1] == pgid for d in Path("/proc").glob("[0-9]*"))


def run_processes(launcher_pid: int, groups: Iterable[int] = ()) -> list[int]:
    """``rl`` itself (pid ``launcher_pid``) while it runs, every running process whose environment names it as its
    ``rl``, and every running process of ``groups``: give the groups of the processes ``rl`` started (each leads
    one, :func:`rl_runs.started_pids`), since one that the preloaded starter forked (tests/conftest.py) shows the
    starter's environment in ``/proc``, not the one ``rl`` gave it."""
    found = [launcher_pid] if _running(Path(f"/proc/{launcher_pid}")) else []
    found += [pid for pid, _ in marked(LAUNCHER_PID_ENV, str(launcher_pid))]
    groups = set(groups)
    return found + [int(d.name) for d in Path("/proc").glob("[0-9]*") if (seen := _running(d)) and seen[1] in groups]


def wait_gone(what, timeout_s: float) -> float:
    """Wait until ``what()`` is falsy; returns the seconds it took, fails naming what is left after ``timeout_s``."""
    start = time.monotonic()
    while left := what():
        assert time.monotonic() - start < timeout_s, f"still running after {timeout_s:.0f}s: {left}"
        time.sleep(0.2)
    return time.monotonic() - start
