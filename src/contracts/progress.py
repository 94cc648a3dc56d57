"""What each process is doing right now, for the person watching ``rl``: ``progress/<process>.json``.

The trainer and the orchestrator each keep the activities they are in (training step 12, evaluating weights
step 10: 40/64 rollouts, writing a checkpoint, ...) with the time each began, in one small JSON file rewritten
in one step whenever an activity begins or ends (and at most once a second as its count moves). ``rl`` reads
the files while a step runs long and shows what it is waiting on and for how long.
"""

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from contracts.atomic_io import atomic_file
from contracts.run_dir import progress_dir

COUNT_WRITE_S = 1.0  # a moving count rewrites the file at most this often
HEARTBEAT_S = 10.0  # a waiting process rewrites its file at least this often (:func:`last_written`)


@dataclass
class Activity:
    """One thing a process is doing: ``text``, since ``since`` (epoch seconds), ``done`` of ``total`` if counted."""

    process: str
    text: str
    since: float
    done: int = 0
    total: int | None = None
    unit: str = ""  # what it counts

    def describe(self, now: float) -> str:
        count = f", {self.done}/{self.total} {self.unit} done" if self.total is not None else ""
        return f"{self.process}: {self.text}{count} ({now - self.since:.0f}s)"


class Progress:
    """The activities of one process, written to ``progress/<process>.json`` (nothing is written when
    ``output_dir`` is None: a trainer rank other than the first)."""

    def __init__(self, output_dir: str | Path | None, process: str):
        self.path = progress_dir(output_dir) / f"{process}.json" if output_dir is not None else None
        self.process = process
        self.activities: dict[int, Activity] = {}
        self.written = 0.0
        self.write()

    def begin(self, text: str, total: int | None = None, unit: str = "") -> Activity:
        """Mark ``text`` as under way; with ``total``, it counts its parts (``unit``, :meth:`advance`) and ends with
        the last."""
        activity = Activity(self.process, text, time.time(), total=total, unit=unit)
        self.activities[id(activity)] = activity
        self.write()
        return activity

    def end(self, activity: Activity) -> None:
        if self.activities.pop(id(activity), None) is not None:
            self.write()

    def advance(self, activity: Activity, parts: int = 1) -> None:
        """``parts`` more of ``activity`` are done."""
        activity.done += parts
        if activity.total is not None and activity.done >= activity.total:
            self.end(activity)
        elif time.monotonic() - self.written >= COUNT_WRITE_S:
            self.write()

    @contextmanager
    def doing(self, text: str) -> Iterator[Activity]:
        """Mark ``text`` as under way for the ``with`` block."""
        activity = self.begin(text)
        try:
            yield activity
        finally:
            self.end(activity)

    def write(self) -> None:
        self.written = time.monotonic()
        if self.path is None:
            return
        atomic_file(self.path, json.dumps([vars(a) for a in self.activities.values()]))


def last_written(output_dir: str | Path, process: str) -> int | None:
    """When ``process`` last wrote its progress (ns since the epoch; None before it did): a sign of life, since a
    running orchestrator rewrites it at least every :data:`HEARTBEAT_S`."""
    try:
        return (progress_dir(output_dir) / f"{process}.json").stat().st_mtime_ns
    except OSError:
        return None


def read_progress(output_dir: str | Path) -> list[Activity]:
    """Every process's activities under way, the longest-running first."""
    activities = []
    for path in sorted(progress_dir(output_dir).glob("*.json")):
        try:
            activities += [Activity(**record) for record in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError):  # gone with its process, or from another version
            continue
    return sorted(activities, key=lambda a: a.since)
