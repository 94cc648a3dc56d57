"""The trainer's end of a weight transport, one sender per way the weights reach the inference servers: as files in
their weights folder (:mod:`.files`), or from the trainer's memory over a process group (:mod:`.process_group`) or a
buffer shared with the server (:mod:`.shared_buffer`), the folder then holding their manifest
(:mod:`contracts.weight_manifest`), from which the server picks its receiver (``inference/transports/``)."""

import socket
import threading
import uuid
from abc import ABC, abstractmethod
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from contracts.errors import TridentError
from contracts.weight_manifest import manifest_for, write_manifest


class ExportedWeights(NamedTuple):
    """A step's weights for inference, as rank 0 holds them once gathered."""

    tensors: dict[str, Tensor]  # full weights under the base model's names, or a LoRA adapter's
    owner: nn.Module  # the model whose ``save_pretrained`` writes them as files (HF's, or a peft model)
    dtype: torch.dtype | None  # full weights' dtype, which their config.json records; None: an adapter's
    step: int = 0  # the weights step (their folder's ``step_N``)


class WeightSender(ABC):
    """Rank 0's end of one weight transport: :meth:`send` takes each step's weights before their folder is
    written, :meth:`write` writes into the folder what a server loads them from."""

    @abstractmethod
    def send(self, weights: ExportedWeights) -> None:
        """Hand ``weights`` over to the servers (an in-memory sender first waits until the previous were taken)."""

    @abstractmethod
    def write(self, folder: Path) -> None:
        """Write into the (temporary) weights folder what a server loads the weights last sent from."""


class MemorySender(WeightSender):
    """What the in-memory senders share: one session of the store the trainer hosts at ``host:port``, the manifest
    each weights folder holds, and the error their background threads leave for :meth:`wait` to raise."""

    def __init__(self, host: str, port: int, timeout_s: float, backend: str):
        self.address = {"host": host, "port": port, "session": uuid.uuid4().hex, "backend": backend}
        self.timeout_s = timeout_s
        self.store = None  # the store the trainer hosts, from the first send
        self.sequence = 0  # how many weights were sent
        self.sent: dict = {}  # the manifest of the weights last sent
        self.changed = threading.Condition()  # guards the sender's state its threads share, and error
        self.error: Exception | None = None

    @abstractmethod
    def offer(self, tensors: dict[str, Tensor]) -> dict:
        """Hold ``tensors`` as the newest weights for the servers; their manifest."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the servers took the weights last sent, at most ``timeout_s``; raise if they did not."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving the servers and release what the sender holds; the servers keep what they took."""

    def send(self, weights: ExportedWeights) -> None:
        self.sent = self.offer(weights.tensors)

    def write(self, folder: Path) -> None:
        write_manifest(folder, self.sent)

    def manifest(self, tensors: dict[str, Tensor], checksum: str | None = None) -> dict:
        return manifest_for(
            tensors, **self.address, timeout_s=self.timeout_s, sequence=max(self.sequence, 1), checksum=checksum
        )

    def host_store(self) -> dist.TCPStore:
        """Host the session's store, listening on its host only (a TCPStore of its own listens on every interface).
        One connection serves one thread at a time (a wait holds it)."""
        host, port, timeout = self.address["host"], self.address["port"], timedelta(seconds=self.timeout_s)
        listening = listen(host, port)
        return dist.TCPStore(
            host, port, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listening
        )

    def failure(self, error: Exception) -> TridentError:
        address = f"{self.address['host']}:{self.address['port']}"
        return TridentError(
            f"weight broadcast ({self.address['backend']}, store {address}) failed: the inference server did not "
            f"receive the weights within weight_broadcast.timeout_s = {self.timeout_s:.0f}s, or left ({error})"
        )

    def raise_error(self) -> None:
        """Raise what a background thread met, as one line."""
        if self.error is not None:
            raise self.failure(self.error)

    def run(self, work, *args) -> None:
        """``work(*args)``, keeping what it raises of torch's store and group errors for :meth:`wait`."""
        try:
            work(*args)
        except (RuntimeError, OSError) as e:  # torch's DistBackendError and store timeouts; the port taken
            with self.changed:
                self.error = e
                self.changed.notify_all()


def listen(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only, as a file descriptor a TCPStore takes over."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    server = socket.socket(family, kind, proto)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(address)
        server.listen()
    except OSError:
        server.close()
        raise
    return server.detach()
