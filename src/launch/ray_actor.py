"""One process of a run on a Ray node: an actor that says where it is (its node's address, a free port there), runs
``python -m <module> @ <config>`` there as a child, hands its output lines to ``rl``, reports its exit code and stops
its process group; and ``rl``'s side of it.

``rl`` creates one :class:`ProcessActor` per placed rank in the run's placement group (:mod:`launch.ray_run`) and
holds a :class:`RayChild` for it, which looks to :func:`launch.launcher.supervise` like a local
:class:`launch.process.Child`: ``poll()`` also copies the lines the process wrote since into
``output_dir/logs/<name>.log`` on ``rl``'s node, so logs need no shared filesystem.

When the actor dies (``rl`` gone, which Ray's actors fate-share with, killed, or its worker crashed), its process
group goes with it: Ray SIGKILLs the actor's direct child, and a guard, started outside the actor's children
(:func:`start_guard`), stops the rest of the group (a server's engine, a trainer's helpers), which the child's own
lifeline (:mod:`contracts.lifeline`, watching the actor) cannot once it is killed. Ray is imported only when a run
uses it.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from contracts.lifeline import GRACE_S, LAUNCHER_PID_ENV

POLL_S = 0.5  # rl asks each actor for its process's lines and exit code at most this often
STOP_MARGIN_S = 30.0  # beyond a stop's grace, how long rl waits for an actor's answer before it ends the actor


def start_guard(group: int, grace_s: float = GRACE_S) -> None:
    """Start a process that stops process group ``group`` once this one (the actor) has exited: not a child of this
    one (a shell starts it in a session of its own and exits), so that Ray's SIGKILL of a dead actor's children
    spares it."""
    code = f"from contracts.lifeline import guard_group; guard_group({os.getpid()}, {group}, {grace_s})"
    subprocess.run(["/bin/sh", "-c", '"$@" </dev/null >/dev/null 2>&1 &', "guard", sys.executable, "-c", code],
                   check=True, start_new_session=True)  # fmt: skip


def write_atomically(path: Path, text: str) -> None:
    """Write ``path`` under a temporary name, then rename it: a process reading it never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    temporary.replace(path)


class ProcessActor:
    """Runs one process on its node (made a Ray actor with ``ray.remote(ProcessActor)``): where it is first
    (:meth:`node_address`, :meth:`free_port`), then :meth:`start`."""

    def __init__(self):
        self.popen: subprocess.Popen | None = None
        self.lines: list[bytes] = []
        self.lock = threading.Lock()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def node_address(self) -> str:
        """This node's address in the cluster, where the other nodes reach its processes."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now (for a trainer's rendezvous)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def start(self, argv: list[str], env: dict[str, str], files: dict[str, str]) -> int:
        """Write ``files`` (path -> text: the process's resolved config and the run spec), then start ``argv`` with
        ``env`` over this node's environment (Ray's ``CUDA_VISIBLE_DEVICES`` kept) and its guard; its pid."""
        for path, text in files.items():
            write_atomically(Path(path), text)
        env = dict(os.environ) | env | {LAUNCHER_PID_ENV: str(os.getpid())}  # its lifeline watches this actor
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True)  # fmt: skip
        start_guard(self.popen.pid)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self.popen.pid

    def _read(self) -> None:
        for line in self.popen.stdout:
            with self.lock:
                self.lines.append(line)

    def output(self) -> bytes:
        """The lines the process wrote since the last call."""
        with self.lock:
            taken, self.lines = self.lines, []
        return b"".join(taken)

    def poll(self) -> tuple[int | None, bytes]:
        """The process's exit code (None while it runs; once it is known, every line has been read) and the lines
        it wrote since the last call."""
        code = self.popen.poll()
        if code is not None:
            self.reader.join(timeout=5)  # a descendant left holding its output does not hold this up
        return code, self.output()

    def stop(self, grace_s: float = GRACE_S) -> int:
        """SIGTERM the process's group, SIGKILL what is left after ``grace_s``; its exit code."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace_s
            while sig == signal.SIGTERM and time.monotonic() < deadline and self._group_alive():
                time.sleep(0.1)
        return self.popen.wait()

    def _group_alive(self) -> bool:
        self.popen.poll()
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        return True


class RayChild:
    """``rl``'s handle on a :class:`ProcessActor` running process ``name`` on ``node`` (at ``address``): the interface
    of a local child, its log written on ``rl``'s node; ``lost``: the line that says why, once its actor has died."""

    lost: str | None = None

    def __init__(self, name: str, actor, log_path: Path, node: str = "", address: str = ""):
        self.name, self.actor, self.log_path, self.node, self.address = name, actor, log_path, node, address
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_bytes(b"")
        self.code: int | None = None
        self.polled = float("-inf")

    def poll(self) -> int | None:
        """Copy the process's new lines into its log (at most every :data:`POLL_S`); its exit code once it has exited
        and every line is copied, or -9 once its actor has died (:attr:`lost` says how)."""
        import ray

        if self.code is None and time.monotonic() - self.polled >= POLL_S:
            self.polled = time.monotonic()
            try:
                code, lines = ray.get(self.actor.poll.remote())
            except ray.exceptions.RayError as error:  # the actor died (an OutOfMemoryError when Ray killed it)
                code, lines, self.lost = -signal.SIGKILL, b"", self.why_lost(error)
            self.write(lines)
            self.code = code
        return self.code

    def why_lost(self, error: Exception) -> str:
        """The line that says the actor died (``error``: what asking it raised): its node left the cluster, Ray's
        memory monitor killed it, or it was killed (or crashed) there."""
        import ray

        where = f"node {self.node} ({self.address})"
        if not any(node["NodeID"] == self.node and node["Alive"] for node in ray.nodes()):
            what = f"{where} left the cluster"
        elif isinstance(error, ray.exceptions.OutOfMemoryError):
            what = f"Ray killed its actor on {where}, which ran low on memory (RAY_memory_usage_threshold)"
        else:
            what = f"its Ray actor died on {where}: killed, or its worker crashed"
        return f"{self.name} is gone: {what} (its log: {self.log_path})"

    def write(self, lines: bytes) -> None:
        with self.log_path.open("ab") as log:
            log.write(lines)

    def stop(self, grace_s: float = GRACE_S) -> None:
        """Stop the process (its group on its node), copy its last lines, then end the actor."""
        self.finish(self.actor.stop.remote(grace_s), grace_s)

    def finish(self, stopping, grace_s: float = GRACE_S) -> None:
        """Wait for the actor's :meth:`ProcessActor.stop` under way (``stopping``, which takes ``grace_s`` at most),
        copy the process's last lines, then end the actor; an actor that died, or whose node does not answer, is
        ended as it is."""
        import ray

        try:
            code = ray.get(stopping, timeout=grace_s + STOP_MARGIN_S)
            self.write(ray.get(self.actor.output.remote(), timeout=STOP_MARGIN_S))
            self.code = code if self.code is None else self.code
        except ray.exceptions.RayError:
            pass
        ray.kill(self.actor)
