"""Writing files and folders so that a crash never leaves half of one: a folder is filled under a hidden temporary
name and renamed into place once on the disk (fsynced), a file is replaced through a temporary sibling, and a write
that fails for lack of space is one readable line. Readers see the old or the new contents, never a mix."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from contracts.errors import TridentError


class DiskFullError(TridentError):
    """A file of the run could not be written for lack of space."""


LOW_SPACE_BYTES = 16 * 2**20  # free space below this after a failed write: the write failed for lack of space


def disk_full(path: Path) -> bool:
    """Whether the filesystem of ``path`` has (next to) no space left that this process may use."""
    try:
        return shutil.disk_usage(path).free < LOW_SPACE_BYTES
    except OSError:
        return False


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's contents (a folder's: its entries) from the page cache to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file and folder under ``folder``, and ``folder`` itself, to the disk (files first)."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def aside(final: Path) -> Path:
    """Where :func:`move_into_place` keeps the folder it replaces until the new one is in."""
    return final.with_name(f".{final.name}.old")


def recover_aside(final: Path) -> None:
    """Finish a replacement a crash interrupted: put the old folder back if the new one never came in, else
    delete it."""
    old = aside(final)
    if old.exists() and not final.exists():
        old.rename(final)
    elif old.exists():
        shutil.rmtree(old)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``, its contents on the disk first; an existing ``final`` is
    renamed aside and deleted only once the new one is in, so a crash leaves the old or the new folder whole."""
    fsync_tree(tmp)
    recover_aside(final)
    if final.exists():
        final.rename(aside(final))
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(aside(final), ignore_errors=True)


@contextmanager
def atomic_dir(final: Path, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it is renamed to ``final`` in one step.

    Readers never see a partial folder: it has a hidden temporary name until complete, and is on the disk
    (fsynced) before it is renamed (see :func:`move_into_place`). A failure (or a kill) leaves only a ``.tmp``
    folder that no reader looks at. A write that fails for lack of space (whatever the writing library raises:
    OSError, safetensors' or torch's own errors) becomes a one-line :class:`DiskFullError`, with the partial folder
    removed. With ``replace`` False, a ``final`` that another writer completed meanwhile is kept and this folder
    dropped.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if replace:
            move_into_place(tmp, final)
        else:
            keep_first(tmp, final)
    except BaseException as e:
        full = isinstance(e, Exception) and disk_full(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(
                f"no space left on the disk of {final.parent}: could not write {final.name}, nothing of it was kept "
                f"and what was written before is intact ({free_space(final.parent)} free; free space, then resume "
                "with --ckpt.resume-step -1)"
            ) from e
        raise


def keep_first(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` unless another writer completed ``final`` first (then drop ``tmp``)."""
    fsync_tree(tmp)
    try:
        tmp.rename(final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp)
        return
    fsync_path(final.parent)


def free_space(path: Path) -> str:
    """The space free on the disk of ``path``, for an error message (``unknown`` where it cannot be read)."""
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


def atomic_file(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` through a temporary sibling renamed over it: readers see the old or the
    new content, also after a crash (it is on the disk before the rename, the rename before this returns)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(text) if isinstance(text, bytes) else tmp.write_text(text)
    fsync_path(tmp)
    tmp.replace(path)
    fsync_path(path.parent)
