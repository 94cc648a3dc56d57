"""Each failed rollout of a step, kept in the run (``metrics/failed_rollouts.jsonl``) with its full error: the step's
log line and error name only its cause (:mod:`~orchestrator.batching.causes`); an evaluation's too, marked so."""

from pathlib import Path

from contracts.records import append_records
from contracts.run_dir import FAILED_ROLLOUTS, metrics_path
from orchestrator.batching.causes import cause_key
from orchestrator.batching.rollout import Rollout


def failed_rollout_records(step: int, groups: list[list[Rollout]], evaluation: bool = False) -> list[dict]:
    """A record (:data:`~contracts.run_dir.FAILED_ROLLOUT_KEYS`) for each failed rollout of step ``step``'s
    ``groups`` (an evaluation's of weights step ``step`` when ``evaluation``), lost ones included, in the groups'
    order."""
    return [
        {"step": step, "env": r.env, "task": r.task, "seat": r.seat, "cause": cause_key(r.error or ""),
         "error": r.error or "", "traceback": r.traceback, "lost": r.lost, "eval": evaluation}
        for group in groups for r in group if not r.ok
    ]  # fmt: skip


def write_failed_rollouts(output_dir: Path, step: int, groups: list[list[Rollout]], evaluation: bool = False) -> int:
    """Append the records of step ``step``'s failed rollouts (an evaluation's, of weights step ``step``, when
    ``evaluation``) to the run's ``metrics/failed_rollouts.jsonl``; returns how many. A training step's are written
    before its batch is built, so that a step that stops the run keeps them too."""
    records = failed_rollout_records(step, groups, evaluation)
    if records:
        path = metrics_path(output_dir, FAILED_ROLLOUTS)
        path.parent.mkdir(parents=True, exist_ok=True)
        append_records(path, records)
    return len(records)
