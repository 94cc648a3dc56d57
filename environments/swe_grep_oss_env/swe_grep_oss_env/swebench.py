"""SWE-bench Lite style records from any dataset :mod:`dataset_rows` reads (a JSONL or parquet file, a folder of
them, a ``save_to_disk`` folder, a hub id), with local repository snapshots.

Each row has ``instance_id``, ``problem_statement`` and ``patch`` (the gold diff; the answer is the set of files it
touches), and optionally ``repo_path``. The repository snapshot of a row is the directory ``repo_path`` when the
row has one (relative paths start at the dataset's folder: a file's folder, a folder itself, or the working
directory for a hub id), else ``<repos_dir>/<instance_id>``, where ``repos_dir`` defaults to ``repos/`` in the
dataset's folder. The snapshot should be the repository at the row's base commit; its ``.git`` is never copied
into a rollout.
"""

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dataset_rows import DatasetError, DatasetSpec, Row, read_rows

REQUIRED_FIELDS = ("instance_id", "problem_statement", "patch")


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


def read_records(spec: DatasetSpec, repos_dir: Path | None = None) -> Iterator[Record]:
    """The records of the dataset ``spec`` names, as they are read; a :class:`DatasetError` naming the file and
    row (its line in a JSONL file) of the first bad one."""
    path = Path(spec.path)
    folder = path.parent if path.is_file() else path if path.is_dir() else Path(".")
    repos_dir = repos_dir if repos_dir is not None else folder / "repos"
    for row in read_rows(spec):
        yield _record(row, folder, repos_dir)


def _record(row: Row, folder: Path, repos_dir: Path) -> Record:
    data = row.data
    for name in REQUIRED_FIELDS:
        if data.get(name) is None:
            raise DatasetError(f"{row.where}: missing field {name!r} (each row needs {', '.join(REQUIRED_FIELDS)})")
        if not isinstance(data[name], str) or not data[name].strip():
            raise DatasetError(f"{row.where}: field {name!r} must be a non-empty string")
    answer_files = patch_files(data["patch"])
    if not answer_files:
        raise DatasetError(f"{row.where}: field 'patch' touches no file (expected a unified diff)")
    if data.get("repo_path") is not None:
        if not isinstance(data["repo_path"], str):
            raise DatasetError(f"{row.where}: field 'repo_path' must be a string")
        repo = folder / data["repo_path"]
    else:
        repo = repos_dir / data["instance_id"]
    if not repo.is_dir():
        raise DatasetError(f"{row.where}: no repository snapshot at {repo} (set 'repo_path' in the row or repos_dir)")
    return Record(data["instance_id"], data["problem_statement"], answer_files, str(repo.resolve()))


def copy_snapshot(source: Path, destination: Path) -> None:
    """Copy a repository snapshot without its ``.git`` (history could give the fix away); links stay links."""
    shutil.copytree(source, destination, symlinks=True, ignore=shutil.ignore_patterns(".git"))
