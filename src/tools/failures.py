"""A run's failed rollouts (``metrics/failed_rollouts.jsonl``, :data:`~contracts.run_dir.FAILED_ROLLOUT_KEYS`), its
training steps' and its evaluations', counted by cause, as the rollout inspector and the report show them."""

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text

from contracts.metrics import read_metrics
from contracts.run_dir import FAILED_ROLLOUTS, metrics_path


@dataclass
class FailureCause:
    """Failed rollouts that share a cause (training's, or evaluations'): how many, in which steps, and the first one's
    record."""

    cause: str
    count: int
    steps: list[int]
    first: dict

    @property
    def label(self) -> str:
        """The cause, marked where its rollouts are evaluations'."""
        return f"{self.cause} (in evaluation)" if self.first.get("eval") else self.cause


def read_failures(output_dir: Path, step: int | None = None) -> list[dict]:
    """The run's failed-rollout records, of step ``step`` only when given."""
    records = read_metrics(output_dir, FAILED_ROLLOUTS)
    return [r for r in records if step is None or r.get("step") == step]


def by_cause(records: list[dict]) -> list[FailureCause]:
    """``records`` grouped by their ``cause``, training's apart from evaluations', the most common first (ties: the
    first met first)."""

    def key(record: dict) -> tuple[bool, str]:
        return bool(record.get("eval")), str(record.get("cause", ""))

    groups = []
    for shared, count in Counter(map(key, records)).most_common():
        alike = [r for r in records if key(r) == shared]
        steps = sorted({r["step"] for r in alike if isinstance(r.get("step"), int)})
        groups.append(FailureCause(shared[1], count, steps, alike[0]))
    return groups


def where(record: dict) -> str:
    """Where a failed rollout was: its step (an evaluation's weights step), environment, task and seat."""
    keys = [key for key in ("step", "env", "task", "seat") if record.get(key) not in (None, "")]
    places = [f"{key} {record[key]}" for key in keys]
    if record.get("eval") and places and keys[0] == "step":
        places[0] = f"evaluation of weights step {record['step']}"
    return " · ".join(places)


def full_error(record: dict) -> str:
    """A failed rollout's error in full, then its traceback where it has one."""
    error, trace = str(record.get("error", "")).rstrip(), str(record.get("traceback") or "").rstrip()
    return f"{error}\n{trace}" if trace else error


def failures_view(records: list[dict]) -> Text:
    """``records`` by cause: each cause's count, then the first one's place and full error (unwrapped, to copy)."""
    causes = by_cause(records)
    source = metrics_path(Path(), FAILED_ROLLOUTS)
    text = Text(f"{len(records)} failed rollouts, {len(causes)} causes (from {source})\n", style="bold")
    for group in causes:
        lost = " (infrastructure errors: their groups were left out)" if group.first.get("lost") else ""
        text.append(f"{group.count} × {group.label}{lost}\n", style="bold red")
        text.append(f"first: {where(group.first)}\n", style="dim")
        text.append(full_error(group.first) + "\n")
    return text
