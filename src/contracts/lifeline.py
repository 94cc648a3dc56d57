"""A process of an ``rl`` run ends when ``rl`` ends, however ``rl`` ends (SIGKILL included), and takes the processes
it started with it.

``rl`` puts its pid in ``$TRIDENT_LAUNCHER_PID``. Each process of the run (inference, orchestrator, every trainer
rank) calls :func:`watch_launcher` at start: a thread waits on a pidfd of ``rl``, and once ``rl`` is gone it stops
the process group the process leads (SIGTERM, then SIGKILL after a grace), so no server keeps a port or a GPU.

Processes started in sessions of their own (verifiers' tool servers and harness programs) are outside that group:
:func:`stop_descendants_on_exit` has a process stop them when it ends or gets SIGTERM, having made itself their
reaper (Linux's child subreaper), so that those whose parent exited first are still found. A process SIGKILLed runs
no exit at all: whoever started it can mark it with an environment variable, which its descendants inherit, and
:func:`stop_marked` them once it is gone (how the orchestrator stops a killed rollout worker's tool servers).
"""

import atexit
import ctypes
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Collection
from pathlib import Path

LAUNCHER_PID_ENV = "TRIDENT_LAUNCHER_PID"
GRACE_S = 10.0  # between SIGTERM and SIGKILL, as rl's own stop

logger = logging.getLogger("contracts.lifeline")


def launcher_env() -> dict[str, str]:
    """What ``rl`` adds to its children's environment so that they watch it."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def watch_launcher(grace_s: float = GRACE_S) -> None:
    """Stop this process's group (or, when it leads none, this process) once ``rl`` has exited.

    Does nothing for a process started by hand (no ``$TRIDENT_LAUNCHER_PID``).
    """
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if pid is None:
        return
    try:
        pidfd = os.pidfd_open(int(pid))
    except ProcessLookupError:  # rl exited before this process started watching
        pidfd = None
    threading.Thread(target=_stop_after_exit, args=(int(pid), pidfd, grace_s), name="lifeline", daemon=True).start()


def _stop_after_exit(pid: int, pidfd: int | None, grace_s: float) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the process has exited
    leader = os.getpgrp() == os.getpid()  # rl starts each child as a group leader; never stop a caller's group
    logger.warning(f"rl (pid {pid}) has exited: stopping {'process group' if leader else 'process'} {os.getpid()}")
    # A shell does it: it ignores the SIGTERM it sends, so it outlives this process to send the SIGKILL.
    target = 0 if leader else os.getpid()  # `kill 0`: the shell's own group, which is this one
    subprocess.Popen(["/bin/sh", "-c", f"trap '' TERM; kill -TERM {target}; sleep {grace_s:g}; kill -KILL {target}"])


PR_SET_CHILD_SUBREAPER = 36
DESCENDANTS_GRACE_S = 5.0  # well inside rl's own grace for this process


def stop_descendants_on_exit(grace_s: float = DESCENDANTS_GRACE_S) -> None:
    """Stop the processes this one started in sessions of their own, at any depth, when this one exits or gets
    SIGTERM (which then ends it with exit code 143 through ``SystemExit``, so ``finally`` blocks run). Processes in
    this one's own group go with it: ``rl`` and the lifeline stop the group."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # orphaned descendants become this process's children
        logger.warning(f"could not become the reaper of orphaned descendants (errno {ctypes.get_errno()})")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    atexit.register(stop_descendants, grace_s)


def _exit_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the teardown short
    signal_descendants(signal.SIGTERM)  # at once: rl allows this process a grace of its own
    raise SystemExit(128 + signal.SIGTERM)


def descendant_groups(pid: int) -> set[int]:
    """The process groups, other than ``pid``'s own, of ``pid``'s living descendants (from ``/proc``)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if state != "Z":
            children.setdefault(int(parent), []).append((int(stat.parent.name), int(group)))
    own, groups, todo = os.getpgid(pid), set(), [pid]
    while todo:
        for child, group in children.get(todo.pop(), []):
            todo.append(child)
            groups |= {group} - {own}
    return groups


def signal_descendants(sig: signal.Signals) -> set[int]:
    """Send ``sig`` to the process groups of this process's descendants in sessions of their own; returns them."""
    groups = descendant_groups(os.getpid())
    for group in groups:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return groups


def stop_descendants(grace_s: float = DESCENDANTS_GRACE_S) -> None:
    """SIGTERM the process groups of this process's descendants in sessions of their own, and SIGKILL those left
    after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while signal_descendants(signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.1)
        _reap()
    signal_descendants(signal.SIGKILL)
    _reap()


def _reap(pids: Collection[int] | None = None) -> None:
    """Collect the exit status of ended children, or of those of ``pids`` that are this process's (adopted orphans
    have no one else to wait for them)."""
    if pids is not None:
        for pid in pids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not this process's child, or already collected
                pass
        return
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def marked(name: str, value: str) -> list[tuple[int, int]]:
    """``(pid, process group)`` of each living process whose environment sets ``name`` to ``value``: the process
    started with it and its descendants at any depth, wherever they were re-parented since (from ``/proc``)."""
    mark = f"{name}={value}".encode()
    found = []
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            if mark not in (pid_dir / "environ").read_bytes().split(b"\0"):
                continue
            state, _, group = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append((int(pid_dir.name), int(group)))
    return found


def stop_marked(name: str, value: str, grace_s: float = DESCENDANTS_GRACE_S) -> None:
    """SIGTERM the processes marked ``name=value`` (:func:`marked`) but this one, each with its process group unless
    that is this process's own, and SIGKILL those left after ``grace_s``."""
    deadline, seen = time.monotonic() + grace_s, set()
    while (found := _signal_marked(name, value, signal.SIGTERM)) and time.monotonic() < deadline:
        seen |= found
        time.sleep(0.1)
        _reap(seen)
    if killed := _signal_marked(name, value, signal.SIGKILL):
        seen |= killed
        time.sleep(0.1)
    _reap(seen)


def _signal_marked(name: str, value: str, sig: signal.Signals) -> set[int]:
    own = os.getpgrp()
    found = [(pid, group) for pid, group in marked(name, value) if pid != os.getpid()]
    for pid, group in found:
        try:
            os.kill(pid if group == own else -group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return {pid for pid, _ in found}


def guard_group(watched: int, group: int, grace_s: float = GRACE_S) -> None:
    """Stop process group ``group`` (SIGTERM, then SIGKILL after ``grace_s``) once process ``watched`` has exited;
    return as soon as the group ends by itself. Run in a process outside both: a Ray actor's guard
    (:mod:`launch.ray_actor`), which outlives the actor, whose child Ray SIGKILLs before that child's own lifeline
    can stop the rest of its group."""
    try:
        pidfd = os.pidfd_open(watched)
    except ProcessLookupError:  # gone before this guard started
        pidfd = None
    while _group_alive(group):
        if pidfd is None or select.select([pidfd], [], [], 1.0)[0]:
            _stop_group(group, grace_s)
            return


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(group: int, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        while sig == signal.SIGTERM and _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
