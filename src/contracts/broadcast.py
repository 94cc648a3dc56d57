"""Weights sent from the trainer to the inference server in memory: a two-rank process group of their own (the
trainer rank 0, the server's worker rank 1), NCCL between GPUs and gloo otherwise, found through a TCP store the
trainer hosts; or, for a trainer and a server on one device, a buffer both map (``backend = "shared"``,
:mod:`contracts.shared_weights`: CUDA IPC on a GPU, ``/dev/shm`` on the CPU), the store then only carrying the server's
word that it took the weights.

The trainer writes ``weights/step_N/`` as usual but with a manifest (:data:`MANIFEST`: the store's address and
the tensors' names, shapes and dtypes in sending order, and for a shared buffer its handle and their offsets)
instead of weight files, then broadcasts the tensors (or has written them into the buffer); the server, asked to
load that folder, joins the group (once per trainer session) and receives them in the same order, or copies them
from the buffer. Imported by vLLM's worker process: keep its imports to torch, pydantic (vLLM's own), the standard
library and contracts.errors.
"""

import json
import socket
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist
from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only on Python 3.12+

from contracts.errors import TridentError
from contracts.shared_weights import SharedBuffer, layout

MANIFEST = "broadcast.json"  # in a weights folder: its tensors come over the process group, not from files


def open_group(manifest: dict, rank: int) -> dist.ProcessGroup:
    """Join the two-rank group that ``manifest`` names as ``rank`` (0: the trainer, which hosts the store).
    Blocks until both ranks are there, at most ``manifest["timeout_s"]``."""
    timeout = timedelta(seconds=manifest["timeout_s"])
    prefixed = dist.PrefixStore(manifest["session"], open_store(manifest, rank))
    if manifest["backend"] == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send(group: dist.ProcessGroup, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Rank 0: broadcast ``tensors`` in their order (the manifest's), each moved to ``device`` first."""
    for tensor in tensors.values():
        _broadcast(group, tensor.detach().to(device).contiguous())


def receive(group: dist.ProcessGroup, manifest: dict, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Rank 1: the manifest's tensors, received in its order onto ``device``."""
    received = []
    for name, shape, dtype in manifest["tensors"]:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _broadcast(group, tensor)
        received.append((name, tensor))
    return received


def open_store(manifest: dict, rank: int) -> dist.TCPStore:
    """The trainer's TCP store that ``manifest`` names: hosted by rank 0 (the trainer), listening on that host only,
    joined by rank 1."""
    host, port = manifest["host"], manifest["port"]
    listening = {"master_listen_fd": listen(host, port)} if rank == 0 else {}
    timeout = timedelta(seconds=manifest["timeout_s"])
    return dist.TCPStore(
        host, port, world_size=2, is_master=rank == 0, timeout=timeout, wait_for_workers=False, **listening
    )


def listen(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only (a TCPStore of its own listens on every interface), as a file
    descriptor the store takes over."""
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


def taken_key(manifest: dict) -> str:
    """The store key the server sets once it has copied a shared buffer's weights out."""
    return f"{manifest['session']}/taken/{manifest['sequence']}"


def manifest_for(tensors: dict[str, torch.Tensor], host: str, port: int, session: str, backend: str, timeout_s: float):
    """The manifest of a broadcast of ``tensors`` over the group at ``host:port`` of trainer session ``session``."""
    return {
        "host": host,
        "port": port,
        "session": session,
        "backend": backend,
        "timeout_s": timeout_s,
        "tensors": [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()],
    }


def write_manifest(folder: Path, manifest: dict) -> None:
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest))


WeightDtype = Literal["float32", "bfloat16", "float16"]  # what the trainer sends: its compute dtype


class Manifest(TypedDict):
    """What :func:`manifest_for` writes."""

    host: str
    port: Annotated[int, Field(ge=1, le=65535)]
    session: str
    backend: Literal["nccl", "gloo"]
    timeout_s: Annotated[float, Field(gt=0)]
    tensors: list[tuple[str, list[Annotated[int, Field(ge=0)]], WeightDtype]]


class SharedManifest(TypedDict):
    """What :meth:`Sender.send` writes for a shared buffer: the buffer's handle and each tensor's byte offset."""

    host: str
    port: Annotated[int, Field(ge=1, le=65535)]
    session: str
    backend: Literal["shared"]
    timeout_s: Annotated[float, Field(gt=0)]
    sequence: Annotated[int, Field(ge=1)]
    buffer: dict[str, str | int | bool | None]
    tensors: list[tuple[str, list[Annotated[int, Field(ge=0)]], WeightDtype, Annotated[int, Field(ge=0)]]]


def read_manifest(folder: str | Path) -> dict | None:
    """The broadcast manifest of a weights folder, or None when its weights are files; a ValueError names a
    manifest that is not one."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    text = path.read_bytes()
    try:
        TypeAdapter(Manifest | SharedManifest).validate_json(text, strict=True)
    except ValidationError as e:
        raise ValueError(f"{path} is not a broadcast manifest: {e}") from None
    return json.loads(text)


class Sender:
    """The trainer's end (its rank 0 only): one group (or shared buffer) per trainer process, made with the first
    send. A send goes on in the background until the server has taken those weights (the orchestrator asks for the
    newest); the trainer waits for it before it writes the next weights, so at most one is pending and it is the
    newest. Weights the orchestrator never asks for (it finished first) are left untaken when the trainer exits."""

    def __init__(self, host: str, port: int, timeout_s: float, backend: str, device: torch.device):
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.address = {"host": host, "port": port, "session": uuid.uuid4().hex, "backend": backend}
        self.timeout_s = timeout_s
        self.device = device if backend in ("nccl", "shared") else torch.device("cpu")
        self.group: dist.ProcessGroup | None = None
        self.store: dist.TCPStore | None = None
        self.buffer: SharedBuffer | None = None
        self.sequence = 0  # shared buffer: how many weights were written into it
        self.pending: threading.Thread | None = None
        self.error: Exception | None = None

    def manifest(self, tensors: dict[str, torch.Tensor]) -> dict:
        return manifest_for(tensors, **self.address, timeout_s=self.timeout_s)

    def send(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Start sending ``tensors`` (a shared buffer holds them when this returns); returns the manifest for their
        weights folder. :meth:`wait` for the send before the next."""
        self.wait()
        if self.address["backend"] == "shared":
            manifest = self._share(tensors)
            work, args = self._await_taken, (manifest,)
        else:
            manifest = self.manifest(tensors)
            work, args = self._send, (tensors,)
        self.pending = threading.Thread(target=self._run, args=(work, *args), name="weight-broadcast", daemon=True)
        self.pending.start()
        return manifest

    def wait(self) -> None:
        """Block until the pending send has been received (at most ``timeout_s``); raise if it failed."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        if self.error is not None:
            address = f"{self.address['host']}:{self.address['port']}"
            raise TridentError(
                f"weight broadcast ({self.address['backend']}, store {address}) failed: the inference server did not "
                f"receive the weights within weight_broadcast.timeout_s = {self.timeout_s:.0f}s, or left "
                f"({self.error})"
            )

    def close(self) -> None:
        """Release the shared buffer (its ``/dev/shm`` file goes); the server keeps what it copied."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    def _run(self, work, *args) -> None:
        try:
            work(*args)
        except (RuntimeError, OSError) as e:  # torch's DistBackendError and store timeouts; the port taken
            self.error = e

    def _send(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.group is None:
            self.group = open_group(self.manifest({}), rank=0)
        send(self.group, tensors, self.device)

    def _share(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Write ``tensors`` into the shared buffer (made at the first call); their manifest."""
        entries, nbytes = layout(tensors)
        if self.buffer is None:
            self.buffer = SharedBuffer.create(nbytes, self.device, self.address["session"])
        elif len(self.buffer.data) != nbytes:
            held = len(self.buffer.data)
            raise TridentError(f"weight broadcast: weights of {nbytes} bytes, the shared buffer holds {held}")
        self.buffer.write(tensors, entries)
        self.sequence += 1
        return self.manifest({}) | {"sequence": self.sequence, "buffer": self.buffer.handle, "tensors": entries}

    def _await_taken(self, manifest: dict) -> None:
        """Wait until the server has copied the buffer's weights out (it sets :func:`taken_key`)."""
        if self.store is None:
            self.store = open_store(manifest, rank=0)
        self.store.wait([taken_key(manifest)])
        self.buffer.unlink()  # the server has mapped it for the session: no file is left behind if either dies
