"""The model's tools: ``bash`` (confined to the rollout's copy of the repository) and ``result`` (ends the episode).

Trident's harness imports them by ``module:function`` path, shows the model each one's name, docstring and the
parameters other than ``runtime`` and ``task``, and injects those two: the rollout's verifiers runtime (whose
``workdir`` holds the copy, in ``repo/``) and the task's data (which carries the bash limits).
"""

import asyncio
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swe_grep_oss_env import sandbox

REPO_DIR = "repo"
"""The copy of the repository, inside the rollout's runtime.workdir."""


@dataclass(frozen=True)
class BashLimits:
    timeout_s: float = 10.0
    output_bytes: int = 8192
    memory_mb: int = 2048
    max_processes: int = 256

    @classmethod
    def of(cls, task: Any) -> "BashLimits":
        """The limits a task's data carries (``bash_timeout_s``, ...), defaults for what it lacks."""
        names = {"timeout_s": "bash_timeout_s", "output_bytes": "bash_output_bytes", "memory_mb": "bash_memory_mb"}
        return cls(**{field: getattr(task, name) for field, name in names.items() if hasattr(task, name)})


async def bash(command: str, runtime: Any, task: Any = None) -> str:
    """Run a bash command in the repository (your working directory) and return its output (stdout and stderr).

    Use it to search and read code: grep -rn, find, ls, cat, sed -n 'START,ENDp' FILE, head, wc. There is no
    network; files outside the repository cannot be read or written; a command is killed after a few seconds
    and long output is cut."""
    return await run_confined(Path(runtime.workdir) / REPO_DIR, command, BashLimits.of(task))


def result(files: list[str]) -> str:
    """Name the files that must change to resolve the issue, as paths relative to the repository root, e.g.
    ["pkg/module.py"]; ends the episode."""
    return f"Recorded {len(files)} file(s): {', '.join(files)}" if files else "Recorded no files."


class SandboxUnavailable(RuntimeError):
    """The kernel cannot confine the command (no Landlock), so it is not run."""


async def run_confined(root: Path, command: str, limits: BashLimits) -> str:
    """Run ``bash -c command`` under :mod:`swe_grep_oss_env.sandbox` in ``root``; its output, capped and annotated."""
    if sandbox.landlock_abi() < 1:
        raise SandboxUnavailable("the bash tool needs Linux Landlock to confine commands; refusing to run unconfined")
    if not root.is_dir():
        raise FileNotFoundError(f"no repository copy at {root}")
    argv = [sys.executable, "-I", "-S", sandbox.__file__]
    argv += [f"--cpu-s={int(limits.timeout_s) + 1}", f"--memory-mb={limits.memory_mb}"]
    # bash -p: keep the effective uid, which under root differs from the sandbox's real uid (see sandbox.py)
    argv += [f"--max-processes={limits.max_processes}", str(root), "--", "/bin/bash", "-p", "-c", command]
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as a whole below
        env={"PATH": "/usr/bin:/bin"},  # the command's own environment is sandbox.scrubbed_environment
    )
    output, cut, timed_out = bytearray(), False, False
    try:
        async with asyncio.timeout(limits.timeout_s):
            cut = await _read_capped(process.stdout, output, limits.output_bytes)
            if not cut:
                await process.wait()
    except TimeoutError:
        timed_out = True
    finally:
        _kill_group(process.pid)
        # Drain what the killed command left in the pipe: asyncio's wait() returns only once stdout reached its
        # end, and after a cut the full buffer had paused reading, so a bare wait() could block forever.
        await process.communicate()
    return format_output(bytes(output), process.returncode, limits, cut=cut, timed_out=timed_out)


async def _read_capped(stream: asyncio.StreamReader, output: bytearray, limit: int) -> bool:
    """Read ``stream`` into ``output`` until EOF; True (and stop) once it holds more than ``limit`` bytes."""
    while chunk := await stream.read(65536):
        output.extend(chunk)
        if len(output) > limit:
            return True
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def format_output(output: bytes, returncode: int | None, limits: BashLimits, cut: bool, timed_out: bool) -> str:
    """What the model reads: the output (at most ``limits.output_bytes``) and a note for a cut, a kill or a
    failure."""
    text = output[: limits.output_bytes].decode("utf-8", errors="replace")
    notes = []
    if cut:
        notes.append(f"[output cut at {limits.output_bytes} bytes; narrow the command, e.g. with grep or head]")
    if timed_out:
        notes.append(f"[command killed after {limits.timeout_s:g} s]")
    elif returncode and not cut:
        notes.append(f"[exit code {returncode}]")
    if not text and not notes:
        return "(no output)"
    return "\n".join([text.rstrip("\n")] * bool(text) + notes)
