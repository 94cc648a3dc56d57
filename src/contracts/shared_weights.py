"""Weights handed over in shared memory, for a trainer and an inference server on one device (``[weight_broadcast]
backend = "shared"``): one flat byte buffer both processes map, the trainer writing each step's full weights into it
and the server's worker copying them from it into its own parameters.

On a GPU the buffer is CUDA memory of the trainer's, opened by the worker through a CUDA IPC handle (no copy to the
host, no disk, no NCCL, which cannot pair two ranks on one device); on the CPU it is a file in ``/dev/shm``. The
handle travels in the weights folder's manifest as plain JSON, with each tensor's name, shape, dtype and byte offset
(:func:`layout`). Imported by vLLM's worker process: keep its imports to torch, the standard library and
contracts.errors.
"""

import base64
import os
import re
from pathlib import Path

import torch

from contracts.errors import TridentError

SHM_DIR = Path("/dev/shm")
SHM_NAME = re.compile(r"trident-weights-[0-9a-f]{32}")  # the only files a worker maps
ALIGN = 256  # bytes: each tensor starts at a multiple, as CUDA kernels and every dtype's view want


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list[list], int]:
    """Where each tensor lies in the buffer: ``[name, shape, dtype, offset]`` in order, and the buffer's size."""
    entries, offset = [], 0
    for name, tensor in tensors.items():
        entries.append([name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset])
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return entries, offset


class SharedBuffer:
    """A flat byte buffer shared between two processes of one machine: created by the trainer, attached to by the
    worker from its :meth:`handle`."""

    def __init__(self, data: torch.Tensor, handle: dict, path: Path | None = None):
        self.data, self.handle, self.path = data, handle, path  # path: the /dev/shm file the creator removes

    @classmethod
    def create(cls, nbytes: int, device: torch.device, session: str) -> "SharedBuffer":
        """A new buffer of ``nbytes`` on ``device`` (CUDA memory, or a ``/dev/shm`` file on the CPU)."""
        if device.type == "cuda":
            data = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return cls(data, cuda_handle(data))
        room = os.statvfs(SHM_DIR)
        free = room.f_bavail * room.f_frsize
        if free < nbytes:  # writing past a full tmpfs through the mapping would kill the trainer (SIGBUS)
            raise TridentError(
                f"weight broadcast: {SHM_DIR} has {free / 2**20:.0f} MiB free, the weights need {nbytes / 2**20:.0f} "
                "MiB: enlarge it (e.g. docker --shm-size) or set weight_broadcast.backend = 'gloo'"
            )
        path = SHM_DIR / f"trident-weights-{session}"
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
        data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
        return cls(data, {"kind": "shm", "path": str(path), "nbytes": nbytes}, path)

    @classmethod
    def attach(cls, handle: dict) -> "SharedBuffer":
        """The buffer another process created, from its :attr:`handle`; a ValueError names a handle that is not
        one of Trident's."""
        if handle.get("kind") == "cuda":
            return cls(open_cuda_handle(handle), handle)
        path = Path(str(handle.get("path")))
        if handle.get("kind") != "shm" or path.parent != SHM_DIR or not SHM_NAME.fullmatch(path.name):
            raise ValueError(f"not a shared weights buffer: {handle}")
        nbytes = int(handle["nbytes"])
        if not path.is_file() or path.stat().st_size != nbytes:
            raise ValueError(f"{path}: no shared weights buffer of {nbytes} bytes there (did the trainer stop?)")
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
        return cls(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)), handle)

    def write(self, tensors: dict[str, torch.Tensor], entries: list[list]) -> None:
        """Copy ``tensors`` in at the places ``entries`` (their :func:`layout`) give; done when this returns."""
        for (_, tensor), view in zip(tensors.items(), self._views(entries), strict=True):
            view.copy_(tensor.detach().reshape(view.shape), non_blocking=True)
        if self.data.is_cuda:
            torch.cuda.synchronize(self.data.device)  # the worker may read as soon as the folder is stable

    def read(self, entries: list[list]) -> list[tuple[str, torch.Tensor]]:
        """Each tensor of ``entries`` as a view into the buffer (no copy), by name."""
        return [(entry[0], view) for entry, view in zip(entries, self._views(entries), strict=True)]

    def _views(self, entries: list[list]) -> list[torch.Tensor]:
        views = []
        for name, shape, dtype_name, offset in entries:
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensor {name}: {dtype_name!r} is not a dtype")
            size = int(torch.Size(shape).numel()) * dtype.itemsize
            if offset % ALIGN or offset + size > len(self.data):
                raise ValueError(
                    f"tensor {name} ({size} bytes at {offset}) lies outside a {len(self.data)}-byte buffer"
                )
            views.append(self.data[offset : offset + size].view(dtype).view(shape))
        return views

    def unlink(self) -> None:
        """Remove the creator's ``/dev/shm`` file from the file system: the memory stays mapped in the processes that
        attached, and goes back to the system when the last one exits, however it ends."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Release the buffer (the creator also removes its ``/dev/shm`` file)."""
        self.data = torch.empty(0, dtype=torch.uint8)
        self.unlink()


CUDA_HANDLE_FIELDS = ("device", "handle", "size", "offset", "ref_counter", "ref_counter_offset", "event", "event_sync")


def cuda_handle(data: torch.Tensor) -> dict:
    """The CUDA IPC handle of ``data``'s memory as JSON-able fields (bytes in base64)."""
    shared = data.untyped_storage()._share_cuda_()
    fields = dict(zip(CUDA_HANDLE_FIELDS, shared, strict=True))
    encoded = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in fields.items()}
    return {"kind": "cuda", **encoded}


def open_cuda_handle(handle: dict) -> torch.Tensor:
    """The bytes another process's :func:`cuda_handle` shares, as a uint8 tensor on this process's device."""
    values = [handle[field] for field in CUDA_HANDLE_FIELDS]
    values = [base64.b64decode(v) if field in ("handle", "ref_counter", "event") and v is not None else v
              for field, v in zip(CUDA_HANDLE_FIELDS, values, strict=True)]  # fmt: skip
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(*values)
    device = torch.device("cuda", values[0])
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))
