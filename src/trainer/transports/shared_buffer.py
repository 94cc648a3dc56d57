"""Weights handed over in shared memory, for a trainer and an inference server on one device (``[weight_broadcast]
backend = "shared"``): one flat byte buffer both processes map, the trainer writing each step's full weights into it
and the server's worker copying them from it into its own parameters.

On a GPU the buffer is CUDA memory of the trainer's, opened by the worker through a CUDA IPC handle (no copy to the
host, no disk, no NCCL, which cannot pair two ranks on one device); on the CPU it is a file in ``/dev/shm``. The
handle travels in the weights folder's manifest as plain JSON, with each tensor's byte offset
(:func:`contracts.weight_manifest.layout`); the trainer's store only carries the server's word that it took them."""

import base64
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from contracts.errors import TridentError
from contracts.weight_manifest import CUDA_HANDLE_FIELDS, SHM_DIR, layout, shm_path, taken_key
from contracts.weight_wire import buffer_views
from trainer.transports.base import MemorySender


class SharedBufferSender(MemorySender):
    """Serves one server: a send goes on in the background until that server has taken the weights (it sets
    :func:`~contracts.weight_manifest.taken_key` in the store the trainer hosts), and the trainer waits for it
    before it writes the next."""

    def __init__(self, host: str, port: int, timeout_s: float, device: torch.device):
        super().__init__(host, port, timeout_s, "shared")
        self.device = device
        self.buffer: SharedBuffer | None = None
        self.pending: threading.Thread | None = None  # the wait for the server to take the weights

    def offer(self, tensors: dict[str, Tensor]) -> dict:
        """Write ``tensors`` into the shared buffer (made at the first call), once the server took the previous
        (:meth:`wait`); their manifest."""
        self.wait()
        entries, nbytes = layout(tensors)
        if self.buffer is None:
            self.buffer = SharedBuffer.create(nbytes, self.device, self.address["session"])
        elif len(self.buffer.data) != nbytes:
            held = len(self.buffer.data)
            raise TridentError(f"weight broadcast: weights of {nbytes} bytes, the shared buffer holds {held}")
        self.buffer.write(tensors, entries)
        self.sequence += 1
        manifest = self.manifest({}) | {"buffer": self.buffer.handle, "tensors": entries}
        self.pending = threading.Thread(target=self.run, args=(self._await_taken, manifest), daemon=True)
        self.pending.start()
        return manifest

    def wait(self) -> None:
        """Block until the server took the newest weights, at most ``timeout_s``; raise if it did not."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        self.raise_error()

    def close(self) -> None:
        """Release the shared buffer (its ``/dev/shm`` file goes); the server keeps what it took."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    def _await_taken(self, manifest: dict) -> None:
        """Wait until the server has copied the buffer's weights out."""
        if self.store is None:
            self.store = self.host_store()
        self.store.wait([taken_key(manifest)])
        self.buffer.unlink()  # the server has mapped it for the session: no file is left behind if either dies


class SharedBuffer:
    """The trainer's flat byte buffer, which the server's worker maps from its :attr:`handle`."""

    def __init__(self, data: Tensor, handle: dict, path: Path | None = None):
        self.data, self.handle, self.path = data, handle, path  # path: the /dev/shm file the trainer removes

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
        path = shm_path(session)
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
        data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
        return cls(data, {"kind": "shm", "path": str(path), "nbytes": nbytes}, path)

    def write(self, tensors: dict[str, Tensor], entries: list[list]) -> None:
        """Copy ``tensors`` in at the places ``entries`` (their layout) give; done when this returns."""
        for (_, tensor), view in zip(tensors.items(), buffer_views(self.data, entries), strict=True):
            view.copy_(tensor.detach().reshape(view.shape), non_blocking=True)
        if self.data.is_cuda:
            torch.cuda.synchronize(self.data.device)  # the worker may read as soon as the folder is stable

    def unlink(self) -> None:
        """Remove the ``/dev/shm`` file from the file system: the memory stays mapped in the processes that attached,
        and goes back to the system when the last one exits, however it ends."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Release the buffer (and remove its ``/dev/shm`` file)."""
        self.data = torch.empty(0, dtype=torch.uint8)
        self.unlink()


def cuda_handle(data: Tensor) -> dict:
    """The CUDA IPC handle of ``data``'s memory as JSON-able fields (bytes in base64)."""
    shared = data.untyped_storage()._share_cuda_()
    fields = dict(zip(CUDA_HANDLE_FIELDS, shared, strict=True))
    encoded = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in fields.items()}
    return {"kind": "cuda", **encoded}
