"""Local data for the hub datasets environments load in their own code, and a fast, named failure where the hub
cannot be reached.

:func:`~orchestrator.verifiers_adapter.patches.install_patches` puts :func:`load_dataset` in place of
``datasets.load_dataset``: a call for a hub id that ``[[datasets]]`` maps (:class:`~orchestrator.config.LocalDataset`)
reads the local data instead, its split (and config) as asked; an unmapped id goes to ``datasets`` untouched, except
that where the hub cannot be reached (or ``HF_HUB_OFFLINE`` is set) only a cached copy is tried, and its absence is
one :class:`~dataset_rows.DatasetError` line naming the id and ``[[datasets]]``, at once instead of after ``datasets``'
half a minute of retries.
"""

import functools
import inspect
import socket
import threading
import urllib.request
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import datasets
import huggingface_hub.constants
from dataset_rows import HUB_ID, DatasetError, hidden
from datasets.naming import camelcase_to_snakecase

from contracts.errors import error_line
from orchestrator.config import LOCAL_DATA_READERS, LocalDataset

DOCS = "docs/environments.md#air-gapped-clusters"
PROBE_TIMEOUT_S = 3.0  # a hub that does not accept a connection within this is taken as unreachable
_hub_load_dataset = datasets.load_dataset  # datasets' own, read when this module was imported
_signature = inspect.signature(_hub_load_dataset)
_mapped: list[LocalDataset] = []  # what the running process's config maps (set_local_datasets)


def set_local_datasets(entries: Sequence[LocalDataset]) -> None:
    """Have :func:`load_dataset` read ``entries``' local data for their hub ids (replacing any earlier map)."""
    _mapped[:] = sorted(entries, key=lambda e: -sum(x is not None for x in (e.name, e.split, e.revision)))


def load_dataset(*args, **kwargs):
    """``datasets.load_dataset``, reading the local data ``[[datasets]]`` maps a hub id to, and failing at once, in
    one line naming the id, where an unmapped one needs a hub that cannot be reached."""
    call = _signature.bind(*args, **kwargs).arguments
    path = call["path"]
    if not is_hub_id(path):
        return _hub_load_dataset(*args, **kwargs)
    name, split, revision = call.get("name"), call.get("split"), call.get("revision")
    if entry := local_entry(path, name, split, revision):
        return load_local(entry, name, split, call.get("streaming", False))
    if datasets.config.HF_HUB_OFFLINE or not hub_reachable():
        with offline():  # a cached copy still loads; none fails in a moment
            try:
                return _hub_load_dataset(*args, **kwargs)
            except (ConnectionError, FileNotFoundError):
                raise DatasetError(
                    f"hub dataset {path!r}{_which(name, split)}: the hub ({datasets.config.HF_ENDPOINT}) cannot be "
                    f'reached and no copy is cached; give it local data: [[datasets]] id = "{path}" path = "<file '
                    f'or folder>" ({DOCS})'
                ) from None
    return _hub_load_dataset(*args, **kwargs)


def is_hub_id(path) -> bool:
    """Whether ``path`` names a hub dataset: not a local file or folder, nor one of ``datasets``' own readers."""
    return (
        isinstance(path, str)
        and HUB_ID.fullmatch(path) is not None
        and path not in datasets.packaged_modules._PACKAGED_DATASETS_MODULES
        and not Path(path).expanduser().exists()
    )


def local_entry(hub_id: str, name: str | None, split, revision) -> LocalDataset | None:
    """The most specific ``[[datasets]]`` entry for this call, None where the id has none; a
    :class:`DatasetError` where it has entries, none of them for this config, split or revision."""
    entries = [e for e in _mapped if e.id == hub_id]
    asked = {"name": name, "split": _split_name(split), "revision": revision}
    for entry in entries:
        if all(getattr(entry, key) in (None, value) for key, value in asked.items()):
            return entry
    if entries:
        mapped = "; ".join(_which(e.name, e.split, e.revision).strip() for e in entries)
        raise DatasetError(
            f"hub dataset {hub_id!r}{_which(name, split, revision)} has no local data: [[datasets]] maps it only "
            f"for {mapped}"
        )
    return None


def load_local(entry: LocalDataset, name: str | None, split, streaming: bool):
    """``entry``'s local data, as ``datasets.load_dataset`` gives it for config ``name`` (read from a cache; other
    data is one config) and ``split`` (None: every split, a ``DatasetDict``); a :class:`DatasetError` naming the
    entry where it cannot be read."""
    path = entry.path
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            saved = datasets.load_from_disk(str(path))
            if isinstance(saved, datasets.DatasetDict) and split is not None:
                saved = saved[split]
            return saved.to_iterable_dataset() if streaming and isinstance(saved, datasets.Dataset) else saved
        if path.is_dir() and _caches(path, entry.id):
            with offline():
                return _hub_load_dataset(entry.id, name, split=split, revision=entry.revision,
                                         cache_dir=str(path), streaming=streaming)  # fmt: skip
        if entry.split is None and path.is_dir():  # split by its files' names, as datasets reads a hub folder
            return _hub_load_dataset(str(path), split=split, streaming=streaming)
        files = [path] if path.is_file() else _data_files(path)
        builder = LOCAL_DATA_READERS[files[0].suffix]
        rows_of = entry.split or _split_name(split) or "train"
        return _hub_load_dataset(builder, data_files={rows_of: [str(f) for f in files]}, split=split,
                                 streaming=streaming)  # fmt: skip
    except DatasetError:
        raise
    except Exception as e:
        while e.__cause__ is not None:  # "An error occurred while generating the dataset": the cause says which
            e = e.__cause__
        raise DatasetError(
            f'[[datasets]] id = "{entry.id}" path = "{path}"{_which(name, split)}: cannot be read ({error_line(e)})'
        ) from None


def _data_files(folder: Path) -> list[Path]:
    """The data files of ``folder`` (hidden ones left out), all of one format."""
    files = sorted(
        f for f in folder.rglob("*") if f.suffix in LOCAL_DATA_READERS and f.is_file() and not hidden(f, folder)
    )
    if not files:
        raise DatasetError(f"{folder}: no {'/'.join(LOCAL_DATA_READERS)} files in the folder")
    if len({LOCAL_DATA_READERS[f.suffix] for f in files}) > 1:
        raise DatasetError(f"{folder}: files of several formats ({', '.join(sorted({f.suffix for f in files}))})")
    return files


def _caches(folder: Path, hub_id: str) -> bool:
    """Whether ``folder`` is an HF datasets cache (a ``cache_dir``) holding ``hub_id``: ``<org>___<name>/``, the
    name in datasets' snake case."""
    *org, name = hub_id.split("/")
    return (folder / "___".join([*org, camelcase_to_snakecase(name)])).is_dir()


def _split_name(split) -> str | None:
    """The split a ``split`` argument reads from: "train" for "train[:100]"; None for none (or an expression
    ``datasets`` builds, e.g. ``ReadInstruction``)."""
    return str(split).split("[")[0].split("+")[0] if isinstance(split, str) else None


def _which(name, split, revision=None) -> str:
    """`` (config 'main', split 'train')``, for what is given."""
    parts = [f"{key} {value!r}" for key, value in (("config", name), ("split", split), ("revision", revision)) if value]
    return f" ({', '.join(parts)})" if parts else ""


@functools.cache
def hub_reachable() -> bool:
    """Whether the hub's endpoint (``HF_ENDPOINT``) accepts a connection within :data:`PROBE_TIMEOUT_S`, asked once
    a process; true where a proxy is configured (the proxy decides)."""
    if urllib.request.getproxies():
        return True
    endpoint = urlsplit(datasets.config.HF_ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    answered = []

    def connect():  # on a thread: resolving the host name ignores the timeout
        try:
            socket.create_connection((endpoint.hostname, port), timeout=PROBE_TIMEOUT_S).close()
            answered.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(PROBE_TIMEOUT_S)
    return bool(answered)


@contextmanager
def offline():
    """``datasets`` and the hub client in offline mode inside (each reads its flag at each call)."""
    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = before
