"""What a supervisor of child processes (``rl``, ``rl --sweep``) does around them: their environment, the stop signals
while they run, what it shows while it waits, its log file, and the end of its run (its plots, its exit code)."""

import logging
import os
import re
import signal
import time
from pathlib import Path

from rich.console import Console

from contracts.errors import user_error_line
from contracts.lifeline import launcher_env

logger = logging.getLogger("rl")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def child_env(placement: dict[str, str]) -> dict[str, str]:
    """Environment of a child: its GPUs, one OpenMP thread on CPU (three processes share the cores), and the
    launcher's pid, so that it stops when the launcher is gone (:mod:`contracts.lifeline`)."""
    env = dict(os.environ) | placement | launcher_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def stop_on_signals() -> None:
    """From now on the first stop signal stops the run: it raises KeyboardInterrupt where the supervisor is."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)


def _interrupt(signum, frame):
    """The first stop signal: stop the run. Any later one (uv forwards a scheduler's SIGTERM, so rl gets it twice;
    Ctrl-C pressed again) must not cut the teardown short."""
    keep_stopping()
    raise KeyboardInterrupt


def keep_stopping() -> None:
    """Log any stop signal from now on and go on: the teardown under way finishes."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: logger.warning(f"{signal.Signals(signum).name}: already stopping"))


def ignore_stop_signals() -> None:
    """Ignore stop signals once the run is over. At exit Python resets the handlers it installed to the default, so a
    stop signal arriving while the interpreter finalizes would end ``rl`` by that signal and lose its exit code (a CI
    run saw ``rl`` end by SIGINT, -2, after a SIGTERM it had handled and a teardown it had finished)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file, indented, for the message that a process failed."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "  (no log)"
    return "\n".join(f"  | {line}" for line in text)


def failure_message(name: str, code: int | None, log_path: Path, logger_name: str | None = None) -> str:
    """Why process ``name`` exited with ``code``: the one line it gave (:func:`failure_line`; its log's lines logged
    as ``logger_name``, ``name`` by default) and where its log is, else its log's last lines."""
    try:
        cause = failure_line(logger_name or name, log_path.read_text(errors="replace").splitlines())
    except OSError:
        cause = None
    if cause is not None:
        return f"{name} exited with code {code}: {cause} (its log: {log_path})"
    return f"{name} exited with code {code}; last lines of {log_path}:\n{log_tail(log_path)}"


def failure_line(process: str, log_lines: list[str]) -> str | None:
    """The one line ``process`` gave for its failure in ``log_lines``: its user error
    (:func:`~contracts.errors.user_error_line`) or, for a supervisor (an ``rl`` run of a sweep), the one-line
    :func:`failure_message` it logged for its failed child; None where it gave neither."""
    cause = user_error_line(process, log_lines)
    if cause is not None:
        return cause
    mark = re.compile(rf" {re.escape(process)} ERROR (\S+ exited with code -?\d+: .*)")
    return next((found[1] for line in reversed(log_lines) if (found := mark.search(line))), None)


def log_to_file(path: Path) -> None:
    """Send rl's log lines to ``path`` too (written anew), each with its time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger().addHandler(logging.FileHandler(path, mode="w"))
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s rl %(levelname)s %(message)s", "%H:%M:%S"))


class WaitNotice:
    """What the run is doing while a step runs long: a spinner on a terminal, updated every second; elsewhere (a
    log file, CI) a printed line every ``every_s``."""

    def __init__(self, every_s: float):
        console = Console()
        self.status = console.status("waiting for step 1") if console.is_terminal else None
        self.every_s = every_s
        self.shown = time.perf_counter()

    def __enter__(self) -> "WaitNotice":
        if self.status is not None:
            self.status.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.status is not None:
            self.status.stop()

    def due(self, running_s: float) -> bool:
        """Whether to show the notice now, ``running_s`` into what it is about (then it counts as shown): every
        second on a terminal; elsewhere every ``every_s``, once that has run ``every_s``."""
        now = time.perf_counter()
        every = 1.0 if self.status is not None else self.every_s
        if now - self.shown < every or running_s < every:
            return False
        self.shown = now
        return True

    def show(self, text: str) -> None:
        if self.status is not None:
            self.status.update(text)
        else:
            print(text, flush=True)


def write_plots_or_warn(output_dir: Path) -> None:
    """The finished run's plots and ``report.html`` (``trident-plot``); failing to draw them never fails the run."""
    try:
        from tools.plots import plot_runs  # matplotlib is imported only once a run has finished

        logger.info(f"plots and report: {plot_runs([output_dir])}")
    except Exception as e:  # anything (matplotlib, a tokenizer, the disk): a warning, the run has succeeded
        logger.warning(f"could not write the run's plots and report: {type(e).__name__}: {e}")
