"""SWE-bench Lite style records from a local JSONL file, with local repository snapshots.

Each non-blank line is a JSON object with ``instance_id``, ``problem_statement`` and ``patch`` (the gold
diff; the answer is the set of files it touches), and optionally ``repo_path``. The repository snapshot of a
row is the directory ``repo_path`` when the row has one (relative paths start at the JSONL file's directory),
else ``<repos_dir>/<instance_id>``, where ``repos_dir`` defaults to ``repos/`` next to the JSONL file. The
snapshot should be the repository at the row's base commit; its ``.git`` is never copied into a rollout.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

REQUIRED_FIELDS = ("instance_id", "problem_statement", "patch")


class DatasetError(ValueError):
    """A record cannot be used; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class Record:
    instance_id: str
    problem_statement: str
    answer_files: list[str]
    repo_path: str
    """Absolute path of the repository snapshot."""


def patch_files(patch: str) -> list[str]:
    """Files a unified diff touches, in order of appearance: from ``diff --git a/X b/Y`` headers (Y), or from
    ``---``/``+++`` lines when there are none (the ``+++`` side, or the ``---`` side for a deleted file)."""
    files = []
    for line in patch.splitlines():
        if line.startswith("diff --git a/") and " b/" in line:
            files.append(line.rsplit(" b/", 1)[1])
    if not files:
        old = None
        for line in patch.splitlines():
            if line.startswith("--- "):
                old = line[4:].split("\t")[0]
            elif line.startswith("+++ "):
                new = line[4:].split("\t")[0]
                path = old if new == "/dev/null" else new
                if path and path != "/dev/null":
                    files.append(path.removeprefix("a/").removeprefix("b/"))
    return list(dict.fromkeys(files))


def load_records(path: Path, repos_dir: Path | None = None) -> list[Record]:
    """Every record of the JSONL file at ``path``; a DatasetError for the first bad line."""
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    repos_dir = repos_dir if repos_dir is not None else path.parent / "repos"
    records = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            records.append(
                _record(json_object(line, f"{path}:{line_number}"), f"{path}:{line_number}", path, repos_dir)
            )
    return records


def json_object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _record(row: dict, where: str, path: Path, repos_dir: Path) -> Record:
    for name in REQUIRED_FIELDS:
        if name not in row:
            raise DatasetError(f"{where}: missing field {name!r} (each row needs {', '.join(REQUIRED_FIELDS)})")
        if not isinstance(row[name], str) or not row[name].strip():
            raise DatasetError(f"{where}: field {name!r} must be a non-empty string")
    answer_files = patch_files(row["patch"])
    if not answer_files:
        raise DatasetError(f"{where}: field 'patch' touches no file (expected a unified diff)")
    if "repo_path" in row:
        if not isinstance(row["repo_path"], str):
            raise DatasetError(f"{where}: field 'repo_path' must be a string")
        repo = path.parent / row["repo_path"]
    else:
        repo = repos_dir / row["instance_id"]
    if not repo.is_dir():
        raise DatasetError(f"{where}: no repository snapshot at {repo} (set 'repo_path' in the row or repos_dir)")
    return Record(row["instance_id"], row["problem_statement"], answer_files, str(repo.resolve()))


def copy_snapshot(source: Path, destination: Path) -> None:
    """Copy a repository snapshot without its ``.git`` (history could give the fix away); links stay links."""
    shutil.copytree(source, destination, symlinks=True, ignore=shutil.ignore_patterns(".git"))
