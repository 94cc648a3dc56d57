"""Weights copied out of the buffer a trainer on the same device shares (CUDA memory through an IPC handle, or a
``/dev/shm`` file), after which the worker tells the trainer, through its store, that it took them."""

import base64
from pathlib import Path
from typing import Any

import torch

from contracts.weight_manifest import CUDA_HANDLE_BYTES, CUDA_HANDLE_FIELDS, SHM_DIR, SHM_NAME, taken_key
from contracts.weight_wire import buffer_views, connect_store
from inference.transports.base import WeightReceiver


class SharedBufferReceiver(WeightReceiver):
    """One per trainer session: maps the trainer's buffer at the first manifest."""

    def __init__(self, manifest: dict):
        self.session = manifest["session"]
        self.data = attach(manifest["buffer"])
        self.store = connect_store(manifest)

    def receive(self, path: str, manifest: dict) -> dict[str, Any]:
        return {"weights_iterator": iter(self.read(manifest["tensors"]))}

    def read(self, entries: list[list]) -> list[tuple[str, torch.Tensor]]:
        """Each tensor of ``entries`` as a view into the buffer (no copy), by name."""
        return [(entry[0], view) for entry, view in zip(entries, buffer_views(self.data, entries), strict=True)]

    def loaded(self, manifest: dict) -> None:
        """Tell the trainer the weights were copied out: it may overwrite the buffer."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # copied out before the trainer may overwrite the buffer
        self.store.set(taken_key(manifest), "1")


def attach(handle: dict) -> torch.Tensor:
    """The bytes of the buffer a trainer created, from its handle; a ValueError names a handle that is not one of
    Trident's."""
    if handle.get("kind") == "cuda":
        return open_cuda_handle(handle)
    path = Path(str(handle.get("path")))
    if handle.get("kind") != "shm" or path.parent != SHM_DIR or not SHM_NAME.fullmatch(path.name):
        raise ValueError(f"not a shared weights buffer: {handle}")
    nbytes = int(handle["nbytes"])
    if not path.is_file() or path.stat().st_size != nbytes:
        raise ValueError(f"{path}: no shared weights buffer of {nbytes} bytes there (did the trainer stop?)")
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


def open_cuda_handle(handle: dict) -> torch.Tensor:
    """The bytes the trainer's CUDA IPC handle shares, as a uint8 tensor on this process's device."""
    values = [handle[field] for field in CUDA_HANDLE_FIELDS]
    values = [base64.b64decode(v) if field in CUDA_HANDLE_BYTES and v is not None else v
              for field, v in zip(CUDA_HANDLE_FIELDS, values, strict=True)]  # fmt: skip
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(*values)
    device = torch.device("cuda", values[0])
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))
