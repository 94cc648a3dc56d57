"""A preloaded starter: one process that has imported the orchestrator's and the trainer's modules, and forks a
fresh orchestrator or trainer from itself in a fraction of a second, where a new interpreter spends 10-15 CPU
seconds importing torch, transformers and verifiers.

For whoever starts many runs on one machine (the test suite's workers start one each): ``python -m launch.preloaded
SOCKET`` serves on the Unix socket ``SOCKET`` once its imports are done, and an ``rl`` whose environment names it in
``$TRIDENT_PRELOADED`` has it fork its orchestrator and (one-rank) trainer. Each forked process is what ``python -m
<module> @ <config>`` would be: a session of its own, its output in its log, the environment and working directory
``rl`` gives it. What differs: its parent is the starter, not ``rl``, and ``/proc`` shows the starter's command line
and environment for it. ``rl`` falls back to starting the process itself whenever the starter cannot serve it (not
running yet, a torchrun trainer, the inference server, an environment that differs from the starter's in what an
import may read): see :func:`start`.
"""

import atexit
import contextlib
import ctypes
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from contracts.lifeline import LAUNCHER_PID_ENV

PRELOADED_ENV = "TRIDENT_PRELOADED"
MODULES = ("orchestrator.main", "trainer.main")  # the processes it forks
# what those import once their config is read (their imports of torch, transformers, verifiers)
PRELOAD = ("orchestrator.loop.run", "orchestrator.verifiers_adapter.patches", "trainer.parallel", "trainer.train")
# environment variables that may differ between the starter and a process it forks: read when used, never at import
# (pytest's own changes with each test), and how the process was launched (a shell's and uv's bookkeeping, where
# programs are found: `uv run` prepends its environment's bin/ to PATH; the terminal's size, which GNU readline
# exports once a process imports it)
RUNTIME_ENV_PREFIXES = ("TRIDENT_", "WANDB_", "PYTEST_", "UV_")
LAUNCH_ENV = ("PWD", "OLDPWD", "SHLVL", "_", "PATH", "VIRTUAL_ENV", "COLUMNS", "LINES")
PR_SET_PDEATHSIG = 1

logger = logging.getLogger("rl")


def _ask(socket_path: str, request: dict) -> tuple[dict, list[int]]:
    """The starter's reply to ``request``, and the file descriptors it passed with it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(socket_path)
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
        return json.loads(reply), fds


class ForkedProcess:
    """A process the starter forked, with what ``rl`` uses of :class:`subprocess.Popen`: ``pid``, ``poll()``,
    ``wait()``. The starter reaps it and keeps its exit code (negative: the signal that ended it, as Popen's); a
    pidfd of it, passed by the starter before it could be reaped, tells when to ask."""

    def __init__(self, socket_path: str, pid: int, pidfd: int):
        self.socket_path, self.pid, self.pidfd = socket_path, pid, pidfd
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
            try:
                self.returncode = _ask(self.socket_path, {"op": "status", "pid": self.pid})[0]["code"]
            except OSError:  # the starter is gone: nothing is left to tell how its child ended
                self.returncode = 1
            if self.returncode is not None:
                os.close(self.pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode


def start(argv: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess | None:
    """Have the starter ``env`` names in ``$TRIDENT_PRELOADED`` fork ``argv`` (``python -m <module> ...``, a module of
    :data:`MODULES`) with ``env``, its output to ``log_path``; None where it cannot (start the process yourself)."""
    socket_path = env.get(PRELOADED_ENV)
    if not socket_path or len(argv) < 3 or argv[:2] != [sys.executable, "-m"] or argv[2] not in MODULES:
        return None
    request = {"op": "start", "module": argv[2], "args": argv[3:], "env": env, "cwd": os.getcwd(),
               "log": str(log_path)}  # fmt: skip
    try:
        reply, fds = _ask(socket_path, request)
    except OSError:  # not started, or not done importing
        return None
    if "pid" not in reply:
        logger.info(f"the preloaded starter does not start {argv[2]}: {reply['refused']}")
        return None
    return ForkedProcess(socket_path, reply["pid"], fds[0])


def start_starter(socket_path: Path, env: dict[str, str], log_path: Path, wait_s: float = 0) -> subprocess.Popen:
    """Start a starter that serves on ``socket_path``, its output to ``log_path``. ``env`` is the environment ``rl``
    gives the processes it is to fork (:func:`launch.supervise.child_env` with their placement): the starter refuses
    any other. With ``wait_s``, return once it serves (a RuntimeError with its log's end if it exits first or takes
    longer); without, at once: ``rl`` starts its processes itself until the starter serves."""
    env = {key: value for key, value in env.items() if key != LAUNCHER_PID_ENV}  # it watches no launcher
    with log_path.open("wb") as log:
        starter = subprocess.Popen([sys.executable, "-m", "launch.preloaded", str(socket_path)], env=env,
                                   stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + wait_s
    while wait_s and not socket_path.exists():
        if starter.poll() is not None or time.monotonic() > deadline:
            starter.kill()
            raise RuntimeError(f"the preloaded starter did not serve on {socket_path}: {log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    return starter


def stop_starter(starter: subprocess.Popen) -> None:
    """Stop a starter (the processes it forked lead sessions of their own: they are whoever started them's to stop)."""
    starter.terminate()
    starter.wait(timeout=60)


def differing_env(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The variables set differently in ``theirs`` that an import may have read (all but
    :data:`RUNTIME_ENV_PREFIXES`; ``PYTHONPATH`` where it only adds folders, :func:`added_path`)."""
    keys = {key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)}
    if added_path(ours, theirs) is not None:
        keys.discard("PYTHONPATH")
    return sorted(key for key in keys if not key.startswith(RUNTIME_ENV_PREFIXES) and key not in LAUNCH_ENV)


def added_path(ours: dict[str, str], theirs: dict[str, str]) -> list[str] | None:
    """The folders ``theirs``'s ``PYTHONPATH`` puts before ours (``[]`` where they are the same), or None where it
    differs otherwise or an added folder holds a module of a name this process has imported: a process started with
    that ``PYTHONPATH`` would have imported that one. Otherwise a forked process that puts them first on its path
    imports what it would have imported (PYTHONPATH's folders come before the installed packages)."""
    mine, wanted = (env["PYTHONPATH"].split(os.pathsep) if env.get("PYTHONPATH") else [] for env in (ours, theirs))
    added = wanted[: len(wanted) - len(mine)]
    if len(wanted) < len(mine) or wanted[len(added) :] != mine or "" in added:  # "": the working folder
        return None
    imported = {name.partition(".")[0] for name in sys.modules}
    for folder in map(Path, added):
        names = {entry.name.partition(".")[0] for entry in folder.iterdir()} if folder.is_dir() else set()
        if names & imported:
            return None
    return added


def serve(socket_path: str) -> dict:
    """Import :data:`PRELOAD`, then fork a process for each request until this process is stopped (SIGTERM, or its
    parent gone). Returns only in a forked process: its request, for :func:`run_forked`, with what the imports set
    in the environment (as they would have in a process of its own)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # whoever started it is gone: so is it
    signal.signal(signal.SIGTERM, lambda *_: (Path(socket_path).unlink(missing_ok=True), os._exit(0)))
    ours = dict(os.environ)  # what the imports saw
    for module in PRELOAD:
        importlib.import_module(module)
    set_by_imports = {key: value for key, value in os.environ.items() if ours.get(key) != value}  # torch sets some
    server_pid, codes = os.getpid(), {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{socket_path}.{server_pid}")
    listener.listen(16)
    os.rename(f"{socket_path}.{server_pid}", socket_path)  # ready: clients connect only once it is
    try:
        while True:
            readable = select.select([listener], [], [], 0.05)[0]
            with contextlib.suppress(ChildProcessError):
                while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
                    codes[reaped[0]] = os.waitstatus_to_exitcode(reaped[1])
            if not readable:
                continue
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(10)  # a client that sends nothing does not hold the others up
                request = json.loads(conn.makefile("rb").readline())
                fds = None
                if request["op"] == "status":
                    reply = {"code": codes.pop(request["pid"], None)}
                elif refused := differing_env(ours, request["env"]):
                    reply = {"refused": f"set differently from the starter's: {', '.join(refused)}"}
                else:
                    sys.stdout.flush(), sys.stderr.flush()
                    ready, set_up = os.pipe()
                    if (pid := os.fork()) == 0:
                        listener.close(), os.close(ready)
                        return request | {"env": request["env"] | set_by_imports, "ready_fd": set_up,
                                          "path": added_path(ours, request["env"])}  # fmt: skip
                    os.close(set_up)
                    os.read(ready, 1)  # its session and log are set up (or it died): as Popen returns
                    os.close(ready)
                    reply, fds = {"pid": pid}, [os.pidfd_open(pid)]  # before it can be reaped: no other pid's
                if fds is not None:
                    socket.send_fds(conn, [json.dumps(reply).encode() + b"\n"], fds)
                    os.close(fds[0])
                else:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        if os.getpid() == server_pid:
            listener.close()
            Path(socket_path).unlink(missing_ok=True)


def exit_code(value) -> int:
    """What the interpreter makes of ``sys.exit(value)``: None is 0, an int itself, anything else printed, then 1."""
    if value is None or isinstance(value, int):
        return value or 0
    print(value, file=sys.stderr)
    return 1


def run_forked(request: dict) -> None:
    """In the forked process: become ``python -m <module> <args>`` as ``rl`` would have started it (a session of its
    own, its output in its log: done before the starter answers ``rl``), run it, and exit as that process would
    have: its exit code, or 1 and its traceback, after its threads and exit handlers. The starter's modules are
    not torn down (as :mod:`multiprocessing`'s forked children do not): seconds saved at each exit."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0), os.dup2(log, 1), os.dup2(log, 2)
    os.close(devnull), os.close(log)
    os.write(request["ready_fd"], b"1")
    os.close(request["ready_fd"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as `python -m` puts it, then the folders its PYTHONPATH adds to the starter's
    sys.path[1:1] = request["path"]
    sys.argv = [request["module"], *request["args"]]  # runpy sets argv[0] to the module's file
    code, interrupted = 0, False
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        code = exit_code(exit.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what the interpreter does at exit: join the threads, then the exit handlers
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    if interrupted:  # as Python ends on an unhandled KeyboardInterrupt: by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    run_forked(serve(sys.argv[1]))
