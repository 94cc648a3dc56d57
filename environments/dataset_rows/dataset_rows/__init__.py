"""Rows of a dataset read through HF ``datasets``: what an SFT run trains on and the tasks an environment loads.

A :class:`DatasetSpec` names a hub dataset id, a local parquet, JSON Lines or arrow file, a folder of such files
(shards), or a folder written by ``save_to_disk``; the rows are read whole (memory-mapped Arrow) or streamed (read
as they are used, for sets larger than memory), with columns renamed as the spec says. Each row knows where it is
(``file:line``), so a reader's own checks can name it. Shared by the trainer and the environments of this
workspace; not an environment itself.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import datasets

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
"""File suffixes read, and the ``datasets`` builder that reads each."""
HUB_ID = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")
SOURCE, ROW = "__dataset_rows_source", "__dataset_rows_row"  # where a streamed row comes from, through a shuffle


@cache
def hf_datasets():
    """The ``datasets`` module, imported on first use (seconds: configs that name a spec load without it)."""
    import datasets

    datasets.disable_progress_bars()  # a run logs one line a step; datasets' bars would fill its log
    datasets.logging.set_verbosity(logging.CRITICAL)  # what it fails on reaches the user as one DatasetError line
    return datasets


class DatasetError(ValueError):
    """A dataset that cannot be read, or a row that cannot be used; the one-line message names the path, file or
    row at fault."""


class DatasetSpec(BaseModel):
    """Where a dataset's rows come from, and how they are read."""

    model_config = ConfigDict(extra="forbid")

    path: Annotated[
        str,
        Field(
            description="Hub dataset id, or a local parquet, JSONL (.jsonl/.json) or arrow file, a folder of such "
            "files (shards), or a folder written by save_to_disk. Relative paths start at the working directory."
        ),
    ]
    name: Annotated[str | None, Field(description="Configuration (subset) of a hub dataset.")] = None
    split: Annotated[
        str, Field(description="Split of a hub dataset or of a saved DatasetDict; local files are one split.")
    ] = "train"
    columns: Annotated[
        dict[str, str],
        Field(description="Fields read from columns of other names, {field = 'column'}: {messages = 'conversation'}."),
    ] = {}
    streaming: Annotated[
        bool,
        Field(
            description="Read rows as they are used (an IterableDataset) instead of loading the set first: for sets "
            "larger than memory or disk."
        ),
    ] = False
    shuffle_buffer: Annotated[
        int, Field(ge=1, description="Rows a streamed set is shuffled within, when its reader shuffles it.")
    ] = 10_000

    @model_validator(mode="before")
    @classmethod
    def _a_path_alone(cls, data: Any) -> Any:
        """A bare string is the spec of that path: ``dataset = "data/train.parquet"``."""
        return {"path": data} if isinstance(data, str) else data


TASKSET_DATASET_KEYS = ("dataset", "dataset_path")
"""The keys a taskset config's :data:`TasksetDataset` is read from."""
TasksetDataset = Annotated[DatasetSpec | None, Field(validation_alias=AliasChoices(*TASKSET_DATASET_KEYS))]
"""A taskset config's ``dataset``: a path or a spec, also accepted under the environments' former key
``dataset_path``."""


@dataclass(frozen=True)
class Source:
    """One part of a dataset: a local file, a saved dataset, or a hub split."""

    label: str
    lines: Path | None = None
    """The JSON Lines file the part is, whose rows are named by their line."""

    def where(self, index: int) -> str:
        """``label:N`` for the part's row ``index``: its line in a JSON Lines file (the reader skips blank lines),
        else its position counted from 1. For messages: a JSON Lines file is read again to count lines."""
        if self.lines is None:
            return f"{self.label}:{index + 1}"
        with self.lines.open() as file:
            filled = (number for number, line in enumerate(file, start=1) if line.strip())
            return f"{self.label}:{next(itertools.islice(filled, index, None), index + 1)}"


@dataclass(frozen=True)
class Row:
    """A row's fields (renamed by the spec's ``columns``) and where it is."""

    data: dict[str, Any]
    source: Source
    index: int
    """Position in its source, from 0."""

    @property
    def where(self) -> str:
        """``file:line`` (JSON Lines) or ``file:row``, for error messages."""
        return self.source.where(self.index)


def read_rows(spec: DatasetSpec, shuffle_seed: int | None = None) -> Iterator[Row]:
    """The rows of ``spec``'s dataset, in order: the files of a folder one after another (sorted by path). A
    streamed set is shuffled with ``shuffle_seed`` when one is given: its files in a seeded order, their rows
    through a buffer of ``spec.shuffle_buffer``; a loaded one is always read in order (its reader holds it all and
    can shuffle it). Raises :class:`DatasetError`, in one line naming the path, file or row, for a dataset that
    cannot be read or a row without a column ``spec.columns`` names."""
    parts = open_parts(spec)
    if not spec.streaming:
        for source, dataset in parts:
            with reading([source], source.label):
                for index, data in enumerate(dataset):
                    yield Row(renamed(data, spec.columns, source, index), source, index)
        return
    tagged = [
        dataset.map(lambda _, index, s=s: {SOURCE: s, ROW: index}, with_indices=True)
        for s, (_, dataset) in enumerate(parts)
    ]
    stream = hf_datasets().concatenate_datasets(tagged) if len(tagged) > 1 else tagged[0]
    if shuffle_seed is not None:
        # the parts in a seeded order, one at a time through the buffer: filling it from several at once reads them
        # on threads, after which datasets sleeps 5 s for parquet (apache/arrow#45214)
        stream = stream.shuffle(seed=shuffle_seed, buffer_size=spec.shuffle_buffer, max_buffer_input_shards=1)
    sources = [source for source, _ in parts]
    with reading(sources, spec.path):
        for data in stream:
            source, index = sources[data.pop(SOURCE)], data.pop(ROW)
            yield Row(renamed(data, spec.columns, source, index), source, index)


def open_parts(spec: DatasetSpec) -> list[tuple[Source, datasets.Dataset | datasets.IterableDataset]]:
    """Each part of ``spec``'s dataset, opened (loaded, or ready to stream); a :class:`DatasetError` when the path is
    neither a local file or folder nor a hub id, or a part cannot be read."""
    path = Path(spec.path).expanduser()
    if path.is_file():
        return [open_file(path, spec.streaming)]
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return [open_saved(path, spec)]
        files = sorted(
            file for file in path.rglob("*") if file.suffix in FORMATS and file.is_file() and not hidden(file, path)
        )
        if not files:
            raise DatasetError(f"{path}: no {'/'.join(FORMATS)} files in the folder, and not written by save_to_disk")
        return [open_file(file, spec.streaming) for file in files]
    check_found(spec.path)
    source = Source(f"{spec.path}[{spec.split}]")
    with reading([source], f"hub dataset {spec.path!r}"):
        return [(source, hf_datasets().load_dataset(spec.path, spec.name, split=spec.split, streaming=spec.streaming))]


def check_found(path: str) -> None:
    """A :class:`DatasetError` when ``path`` is neither a local file or folder nor, by its form, a hub dataset id
    (checked without ``datasets``: a hub id is not looked up)."""
    local = Path(path).expanduser()
    if not local.exists() and (local.suffix in FORMATS or not HUB_ID.fullmatch(path)):
        raise DatasetError(f"dataset {path!r} not found: no such file or folder, and not a hub dataset id")


def hidden(file: Path, folder: Path) -> bool:
    """Whether ``file`` is hidden in ``folder`` (a dotted name on its way there, e.g. a download tool's ``.cache``)."""
    return any(part.startswith(".") for part in file.relative_to(folder).parts)


def open_file(path: Path, streaming: bool) -> tuple[Source, datasets.Dataset | datasets.IterableDataset]:
    if path.suffix not in FORMATS:
        raise DatasetError(f"{path}: cannot read a {path.suffix or 'suffix-less'} file (expected {'/'.join(FORMATS)})")
    source = Source(str(path), lines=path if path.suffix == ".jsonl" else None)
    with reading([source], source.label):
        builder = FORMATS[path.suffix]
        return source, hf_datasets().load_dataset(builder, data_files=str(path), split="train", streaming=streaming)


def open_saved(path: Path, spec: DatasetSpec) -> tuple[Source, datasets.Dataset | datasets.IterableDataset]:
    with reading([Source(str(path))], str(path)):
        saved = hf_datasets().load_from_disk(str(path))
    if isinstance(saved, hf_datasets().DatasetDict):
        if spec.split not in saved:
            raise DatasetError(f"{path}: no split {spec.split!r} (splits: {', '.join(saved)})")
        saved, path = saved[spec.split], f"{path}[{spec.split}]"
    return Source(str(path)), saved.to_iterable_dataset() if spec.streaming else saved


@contextmanager
def reading(sources: list[Source], label: str) -> Iterator[None]:
    """Turn what ``datasets`` raises while reading ``sources`` into one :class:`DatasetError` line: the first line
    of a JSON Lines file that is not JSON, if there is one, else ``label`` and the reader's first line."""
    try:
        yield
    except DatasetError:
        raise
    except StopIteration:  # datasets' JSON reader, looking for a first row in a file without any
        raise DatasetError(f"{label}: no rows (an empty file)") from None
    except (OSError, ValueError, hf_datasets().exceptions.DatasetsError) as e:  # pyarrow's ArrowInvalid: a ValueError
        for source in sources:
            if source.lines is not None and (bad := first_bad_line(source.lines)):
                raise DatasetError(f"{source.label}:{bad}") from None
        while e.__cause__ is not None:  # "An error occurred while generating the dataset": the cause says which
            e = e.__cause__
        reason = next(iter(str(e).strip().splitlines()), "")
        raise DatasetError(f"{label}: cannot be read ({type(e).__name__}: {reason})") from None


def first_bad_line(path: Path) -> str | None:
    """``N: why`` for the first line of the JSON Lines file ``path`` that is neither blank nor a JSON object."""
    with path.open() as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.strip())
            except json.JSONDecodeError as e:
                return f"{number}: invalid JSON ({e})"
            if not isinstance(value, dict):
                return f"{number}: expected a JSON object, got {type(value).__name__}"
    return None


def renamed(data: dict[str, Any], columns: dict[str, str], source: Source, index: int) -> dict[str, Any]:
    """``data`` with each ``columns`` field taken from its column."""
    for field, column in columns.items():
        if column not in data:
            where = source.where(index)
            raise DatasetError(f"{where}: no column {column!r} to read {field!r} from (columns: {', '.join(data)})")
        data[field] = data.pop(column)
    return data


def without_nulls(value: Any) -> Any:
    """``value`` without the null entries of its dicts, at any depth. A table gives a struct every key that the
    column's structs have anywhere (null where a row had none), which JSON-shaped data (a chat template's messages
    and tools) must not see."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


__all__ = [
    "TASKSET_DATASET_KEYS",
    "DatasetError",
    "DatasetSpec",
    "Row",
    "Source",
    "TasksetDataset",
    "check_found",
    "read_rows",
    "without_nulls",
]
