"""JSON-lines records (the run's ``metrics/*.jsonl``): read so that a line being written or torn by a kill is never
taken for a record, appended so that a torn last line spoils nothing after it, and rewritten whole."""

import json
import logging
import os
from pathlib import Path

from contracts.atomic_io import atomic_file

logger = logging.getLogger("contracts.records")

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


def json_lines(records: list[dict]) -> str:
    """``records`` as JSON lines, one object a line."""
    return "".join(json.dumps(record) + "\n" for record in records)


def append_records(path: Path, records: list[dict]) -> None:
    """Append ``records`` to the JSON-lines file ``path``, one line each; a last line a kill tore is ended first, so
    that it stays one bad line instead of spoiling the first record appended."""
    lines = json_lines(records)
    with path.open("a") as f:
        f.write("\n" + lines if ends_torn(path) else lines)


def ends_torn(path: Path) -> bool:
    """Whether the file ``path`` ends inside a line (written in part when its writer was killed)."""
    if path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def write_records(path: Path, records: list[dict]) -> None:
    """Replace the JSON-lines file ``path`` by ``records`` in one step (:func:`contracts.atomic_io.atomic_file`)."""
    atomic_file(path, json_lines(records))
