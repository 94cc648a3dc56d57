"""A process of an ``rl`` run ends when ``rl`` ends, however ``rl`` ends (SIGKILL included).

``rl`` puts its pid in ``$TRIDENT_LAUNCHER_PID``. Each process of the run (inference, orchestrator, every trainer
rank) calls :func:`watch_launcher` at start: a thread waits on a pidfd of ``rl``, and once ``rl`` is gone it stops
the process group the process leads (SIGTERM, then SIGKILL after a grace), so no server keeps a port or a GPU.
"""

import logging
import os
import select
import subprocess
import threading

LAUNCHER_PID_ENV = "TRIDENT_LAUNCHER_PID"
GRACE_S = 10.0  # between SIGTERM and SIGKILL, as rl's own stop

logger = logging.getLogger("rl.lifeline")


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
