"""One process of a run on a Ray node: an actor that runs ``python -m <module> @ <config>`` there as a child, hands
its output lines to ``rl``, reports its exit code and stops its process group; and ``rl``'s side of it.

``rl`` creates one :class:`ProcessActor` per placed rank in the run's placement group (:mod:`launch.ray_placement`)
and holds a :class:`RayChild` for it, which looks to :func:`launch.launcher.supervise` like a local
:class:`launch.process.Child`: ``poll()`` also copies the lines the process wrote since into
``output_dir/logs/<name>.log`` on ``rl``'s node, so logs need no shared filesystem. When the actor dies (``rl``
gone, which Ray's actors fate-share with, or killed), Ray SIGKILLs its child; the child's own children are left
(not built: the child's lifeline, :mod:`contracts.lifeline`, watching the actor, is killed before it can act).
Ray is imported only when a run uses it.
"""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from contracts.lifeline import GRACE_S, LAUNCHER_PID_ENV


class ProcessActor:
    """Runs one process on this node (made a Ray actor with ``ray.remote(ProcessActor)``)."""

    def __init__(self, argv: list[str], env: dict[str, str], files: dict[str, str]):
        """``env``: overrides of this node's environment (Ray's ``CUDA_VISIBLE_DEVICES`` kept); ``files``: path ->
        text written first (the process's resolved config, where output_dir is not shared)."""
        for path, text in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        env = dict(os.environ) | env | {LAUNCHER_PID_ENV: str(os.getpid())}  # it watches this actor
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True)  # fmt: skip
        self.lines: list[bytes] = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            with self.lock:
                self.lines.append(line)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def output(self) -> bytes:
        """The lines the process wrote since the last call."""
        with self.lock:
            taken, self.lines = self.lines, []
        return b"".join(taken)

    def poll(self) -> int | None:
        """The process's exit code (once its last lines are read), None while it runs."""
        code = self.popen.poll()
        if code is not None:
            self.reader.join(timeout=5)  # a descendant left holding its output does not hold this up
        return code

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
        self.popen.wait()
        return self.poll()

    def _group_alive(self) -> bool:
        self.popen.poll()
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        return True


class RayChild:
    """``rl``'s handle on a :class:`ProcessActor`: the interface of a local child, its log written on ``rl``'s node."""

    def __init__(self, name: str, actor, log_path: Path):
        self.name, self.actor, self.log_path = name, actor, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_bytes(b"")
        self.code: int | None = None

    def poll(self) -> int | None:
        """Copy the process's new lines into its log; its exit code once it has exited (and every line is copied)."""
        import ray

        if self.code is None:
            code = ray.get(self.actor.poll.remote())
            with self.log_path.open("ab") as log:
                log.write(ray.get(self.actor.output.remote()))
            self.code = code
        return self.code

    def stop(self, grace_s: float = GRACE_S) -> None:
        """Stop the process (its group on its node), copy its last lines, then end the actor."""
        import ray

        self.code = ray.get(self.actor.stop.remote(grace_s))
        with self.log_path.open("ab") as log:
            log.write(ray.get(self.actor.output.remote()))
        ray.kill(self.actor)
