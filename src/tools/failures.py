"""A run's failed rollouts (``metrics/failed_rollouts.jsonl``, :data:`~contracts.run_dir.FAILED_ROLLOUT_KEYS`) counted
by cause, as the rollout inspector and the report show them."""

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text

from contracts.metrics import read_metrics
from contracts.run_dir import FAILED_ROLLOUTS, metrics_path


@dataclass
class FailureCause:
    """Failed rollouts that share a cause: how many, in which steps, and the first one's record."""

    cause: str
    count: int
    steps: list[int]
    first: dict


def read_failures(output_dir: Path, step: int | None = None) -> list[dict]:
    """The run's failed-rollout records, of step ``step`` only when given."""
    records = read_metrics(output_dir, FAILED_ROLLOUTS)
    return [r for r in records if step is None or r.get("step") == step]


def by_cause(records: list[dict]) -> list[FailureCause]:
    """``records`` grouped by their ``cause``, the most common first (ties: the first met first)."""
    counts = Counter(str(r.get("cause", "")) for r in records)
    groups = []
    for cause, count in counts.most_common():
        alike = [r for r in records if str(r.get("cause", "")) == cause]
        steps = sorted({r["step"] for r in alike if isinstance(r.get("step"), int)})
        groups.append(FailureCause(cause, count, steps, alike[0]))
    return groups


def where(record: dict) -> str:
    """Where a failed rollout was: its step, environment, task and seat."""
    keys = [key for key in ("step", "env", "task", "seat") if record.get(key) not in (None, "")]
    return " · ".join(f"{key} {record[key]}" for key in keys)


def failures_view(records: list[dict]) -> Text:
    """``records`` by cause: each cause's count, then the first one's place and full error (unwrapped, to copy)."""
    causes = by_cause(records)
    source = metrics_path(Path(), FAILED_ROLLOUTS)
    text = Text(f"{len(records)} failed rollouts, {len(causes)} causes (from {source})\n", style="bold")
    for group in causes:
        lost = " (infrastructure errors: their groups were left out)" if group.first.get("lost") else ""
        text.append(f"{group.count} × {group.cause}{lost}\n", style="bold red")
        text.append(f"first: {where(group.first)}\n", style="dim")
        text.append(str(group.first.get("error", "")).rstrip() + "\n")
    return text
