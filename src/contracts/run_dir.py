"""A run's folder, defined once: where each file lives, and how files are written so that a crash never leaves
half of one (atomic folders and files, ``STABLE`` markers, JSON-lines records). No torch: the launcher and the
tools read runs without it; the batch files themselves are :mod:`contracts.protocol`.


Under ``output_dir``::

    rollouts/step_N/            the batch the trainer trains on at step N (renamed into place: complete or absent)
        micro_batch_K.safetensors   packed tokens of one micro-batch (see :class:`MicroBatch`)
        batch.json                  step metadata (see :class:`BatchInfo`)
    weights/step_N/             HF weights (or a LoRA adapter) after N optimizer steps; ``STABLE`` is written last
    checkpoints/step_N/{trainer,orchestrator}/   state to resume from after N steps (each part ``STABLE``)
    logs/{rl,trainer,orchestrator,inference}.log
    configs/{trainer,orchestrator,inference}.toml   the resolved configs ``rl`` started the processes with
    metrics/{trainer,orchestrator}.jsonl   one JSON object per step (and sample_rollouts.jsonl, eval.jsonl)
    progress/{trainer,orchestrator}.json   what each process is doing now, for the console

Steps are numbered the same way everywhere (folders, metrics, logs, console, ``--ckpt.resume-step``): step N is
the N-th optimizer update, 1..max_steps. It trains on ``rollouts/step_N`` and its result is ``weights/step_N``
(and ``checkpoints/step_N``). Weights ``step_0`` are the initial model: the server starts with them, nothing is
written. The rollouts of step N come from weights ``step_K`` with ``N - 1 - async_level <= K <= N - 1``.
"""

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from contracts.errors import TridentError

STABLE = "STABLE"

logger = logging.getLogger("contracts.run_dir")


def rollouts_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "rollouts" / f"step_{step}"


def weights_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "weights" / f"step_{step}"


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(folder: Path) -> bool:
    """Whether a weights folder holds a LoRA adapter (peft's ``save_pretrained``) rather than full weights."""
    return (Path(folder) / ADAPTER_CONFIG).exists()


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    """``checkpoints/step_N/``: the state after N trainer steps, a ``trainer/`` and an ``orchestrator/`` part."""
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def complete_checkpoints(output_dir: Path) -> list[int]:
    """Steps whose checkpoint is complete (both parts ``STABLE``), oldest first."""
    folders = step_dirs(Path(output_dir) / "checkpoints")
    return [
        step
        for step, folder in folders.items()
        if all(is_stable(folder / part) for part in ("trainer", "orchestrator"))
    ]


def resume_step(output_dir: Path, requested: int) -> int:
    """The checkpoint step to resume from: ``requested``, or the newest complete one for -1.

    Raises a TridentError naming what is missing.
    """
    steps = complete_checkpoints(output_dir)
    if requested == -1 and steps:
        return steps[-1]
    if requested in steps:
        return requested
    found = f"complete checkpoints: steps {steps}" if steps else "no complete checkpoint"
    wanted = "a checkpoint" if requested == -1 else f"checkpoint step {requested}"
    raise TridentError(f"cannot resume from {wanted}: {Path(output_dir) / 'checkpoints'} has {found}")


def logs_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "logs"


def configs_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "configs"


def metrics_path(output_dir: Path, process: str) -> Path:
    return Path(output_dir) / "metrics" / f"{process}.jsonl"


def progress_dir(output_dir: Path) -> Path:
    """``progress/<process>.json``: what each process is doing now (:mod:`contracts.progress`)."""
    return Path(output_dir) / "progress"


def clear_run_state(output_dir: Path, resume_from: int = 0) -> list[Path]:
    """Delete a previous run's rollouts, weights and metrics so a new run never reads them; returns what
    was deleted. A run resuming after ``resume_from`` steps keeps the metrics of those steps (every metrics
    file is read and rewritten before anything is deleted). Logs are overwritten by the new run; checkpoints are
    kept."""
    metrics = Path(output_dir) / "metrics"
    kept = {path: kept_records(path, resume_from) for path in metrics.glob("*.jsonl")} if resume_from else {}
    for path, records in kept.items():
        atomic_file(path, "".join(json.dumps(record) + "\n" for record in records))
    stale = [Path(output_dir) / name for name in ("rollouts", "weights", "progress")]
    stale = [path for path in stale if path.exists()]
    for path in stale:
        shutil.rmtree(path)
    if metrics.exists() and resume_from == 0:
        shutil.rmtree(metrics)
        stale.append(metrics)
    return stale


def kept_records(path: Path, resume_from: int) -> list[dict]:
    """The records of the metrics file ``path`` that a run resuming after ``resume_from`` steps does not write
    again (a torn last line dropped): those of steps 1..resume_from; in ``eval.jsonl``, whose step names the
    weights evaluated, those before ``resume_from`` (the resumed run evaluates the weights it resumes from)."""
    try:
        records = read_records(path, finished=True)
    except OSError as e:
        raise TridentError(f"cannot read {path} to resume: {e.strerror}; fix its permissions or move it away") from e
    last = resume_from - 1 if path.stem == "eval" else resume_from
    return [record for record in records if isinstance(record.get("step"), int) and record["step"] <= last]


_reported: set[tuple[Path, int]] = set()  # bad lines already logged, so a file polled every second logs each once


def read_records(path: Path, finished: bool = False) -> list[dict]:
    """The JSON objects of the JSON-lines file ``path``, skipping (and logging once) each line that is not one.

    A last line without its newline is still being written, and is dropped; with ``finished`` (its writer is gone)
    it was torn by a kill, and is reported as such.
    """
    lines = Path(path).read_bytes().decode(errors="replace").split("\n")
    *complete, last = lines
    records = []
    for number, line in enumerate(complete, 1):
        record = parse_record(line)
        if record is None and line.strip():
            report_once(path, number, f"skipped line {number} of {path}: not a JSON object")
        elif record is not None:
            records.append(record)
    if last and finished:
        report_once(path, len(lines), f"dropped the torn last line of {path} ({len(last)} characters, no newline)")
    return records


def parse_record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def report_once(path: Path, line: int, message: str) -> None:
    if (Path(path), line) not in _reported:
        _reported.add((Path(path), line))
        logger.warning(message)


class DiskFullError(TridentError):
    """A file of the run could not be written for lack of space."""


LOW_SPACE_BYTES = 16 * 2**20  # free space below this after a failed write: the write failed for lack of space


def disk_full(path: Path) -> bool:
    """Whether the filesystem of ``path`` has (next to) no space left that this process may use."""
    try:
        return shutil.disk_usage(path).free < LOW_SPACE_BYTES
    except OSError:
        return False


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's contents (a folder's: its entries) from the page cache to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file and folder under ``folder``, and ``folder`` itself, to the disk (files first)."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def aside(final: Path) -> Path:
    """Where :func:`move_into_place` keeps the folder it replaces until the new one is in."""
    return final.with_name(f".{final.name}.old")


def recover_aside(final: Path) -> None:
    """Finish a replacement a crash interrupted: put the old folder back if the new one never came in, else
    delete it."""
    old = aside(final)
    if old.exists() and not final.exists():
        old.rename(final)
    elif old.exists():
        shutil.rmtree(old)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``, its contents on the disk first; an existing ``final`` is
    renamed aside and deleted only once the new one is in, so a crash leaves the old or the new folder whole."""
    fsync_tree(tmp)
    recover_aside(final)
    if final.exists():
        final.rename(aside(final))
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(aside(final), ignore_errors=True)


@contextmanager
def atomic_dir(final: Path, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it is renamed to ``final`` in one step.

    Readers never see a partial folder: it has a hidden temporary name until complete, and is on the disk
    (fsynced) before it is renamed (see :func:`move_into_place`). A failure (or a kill) leaves only a ``.tmp``
    folder that no reader looks at. A write that fails for lack of space (whatever the writing library raises:
    OSError, safetensors' or torch's own errors) becomes a one-line :class:`DiskFullError`, with the partial folder
    removed. With ``replace`` False, a ``final`` that another writer completed meanwhile is kept and this folder
    dropped.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if replace:
            move_into_place(tmp, final)
        else:
            keep_first(tmp, final)
    except BaseException as e:
        full = isinstance(e, Exception) and disk_full(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(
                f"no space left on the disk of {final.parent}: could not write {final.name}, nothing of it was kept "
                f"and what was written before is intact ({free_space(final.parent)} free; free space, then resume "
                "with --ckpt.resume-step -1)"
            ) from e
        raise


def keep_first(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` unless another writer completed ``final`` first (then drop ``tmp``)."""
    fsync_tree(tmp)
    try:
        tmp.rename(final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp)
        return
    fsync_path(final.parent)


def free_space(path: Path) -> str:
    """The space free on the disk of ``path``, for an error message (``unknown`` where it cannot be read)."""
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


def atomic_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling renamed over it: readers see the old or the new text,
    also after a crash (the text is on the disk before the rename, the rename before this returns)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    fsync_path(tmp)
    tmp.replace(path)
    fsync_path(path.parent)


PROBE_FILE = "probe.json"
PROBE_TEXT = "Probe: the quick brown fox jumps over the lazy dog, 0123456789 times."
# The mean absolute gap (nats) between the server's logprobs of the probe and the trainer's that a reload may leave
# unless client.probe_tolerance says otherwise. Same weights: fp32 on CPU agrees to ~1e-5, bf16 on GPU to ~1e-2.
PROBE_TOLERANCE = 0.05
# A trainer whose frozen base is 4-bit NF4 (QLoRA) scores the probe on the quantized base, the server on its
# unquantized one. That gap was at most 0.020 on the tiny model over 20 adapters (benchmarks/qlora.py): 0.1 leaves
# 5 times that. It grows with how peaked the model is (0.6 on a random model with weights of std 0.2): such runs
# set client.probe_tolerance from their first probe_gap (docs/adapters.md).
PROBE_TOLERANCE_4BIT = 0.1


@dataclass(frozen=True)
class Probe:
    """The trainer's logprobs of the probe text under the weights of a folder (position 0 has none: 0.0), and
    whether it computed them on a 4-bit base (the served adapter's base is not quantized)."""

    token_ids: list[int]
    logprobs: list[float]
    base_in_4bit: bool = False

    @property
    def tolerance(self) -> float:
        """The gap a server may show on these weights when client.probe_tolerance is not set."""
        return PROBE_TOLERANCE_4BIT if self.base_in_4bit else PROBE_TOLERANCE


def write_probe(folder: Path, probe: Probe) -> None:
    """Record the trainer's probe under the weights in ``folder``."""
    (folder / PROBE_FILE).write_text(json.dumps(asdict(probe)))


def read_probe(folder: Path) -> Probe | None:
    """The probe written with these weights, or None for weights written without one (e.g. by hand)."""
    path = folder / PROBE_FILE
    if not path.exists():
        return None
    return Probe(**json.loads(path.read_text()))


def mark_stable(folder: Path) -> None:
    """Write the ``STABLE`` marker last, once the folder's contents are on the disk: they are complete, also after
    a crash."""
    fsync_tree(folder)
    (folder / STABLE).write_text(str(time.time()))
    fsync_path(folder / STABLE)
    fsync_path(folder)


def is_stable(folder: Path) -> bool:
    return (folder / STABLE).exists()


def step_of(folder: Path) -> int | None:
    """The step N of a ``step_N`` folder (of rollouts, weights or checkpoints); None for another name."""
    match = re.fullmatch(r"step_(\d+)", Path(folder).name)
    return int(match.group(1)) if match else None


def step_dirs(parent: Path) -> dict[int, Path]:
    """The ``step_N`` entries of ``rollouts/``, ``weights/`` or ``checkpoints/`` by step, ascending (others skipped)."""
    steps = {step_of(path): path for path in Path(parent).glob("step_*")}
    return {step: steps[step] for step in sorted(step for step in steps if step is not None)}


def latest_stable_weights(output_dir: Path) -> int:
    """The newest weights step with a ``STABLE`` marker, or 0 (the initial model) when there is none."""
    folders = step_dirs(Path(output_dir) / "weights")
    return max((step for step, folder in folders.items() if is_stable(folder)), default=0)


def wait_for(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    poll_s: float = 0.05,
    sign_of_life: Callable[[], object] | None = None,
) -> None:
    """Poll ``condition`` until true; raise TimeoutError naming ``what`` after ``timeout_s`` seconds, counted from
    the last change of ``sign_of_life()`` when given (e.g. when the process that brings ``what`` last wrote its
    progress): a slow peer that works is waited for, a dead or silent one is not."""
    last = sign_of_life() if sign_of_life else None
    deadline = time.monotonic() + timeout_s
    while not condition():
        now = time.monotonic()
        if sign_of_life is not None and (seen := sign_of_life()) != last:
            last, deadline = seen, now + timeout_s
        if now > deadline:
            silent = " with no sign of life from it" if sign_of_life else ""
            raise TimeoutError(f"timed out after {timeout_s:.0f}s{silent} waiting for {what}")
        time.sleep(poll_s)
