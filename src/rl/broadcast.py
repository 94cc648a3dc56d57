"""Weights sent from the trainer to the inference server in memory: a two-rank process group of their own (the
trainer rank 0, the server's worker rank 1), NCCL between GPUs and gloo otherwise, found through a TCP store the
trainer hosts.

The trainer writes ``weights/step_N/`` as usual but with a manifest (:data:`MANIFEST`: the group's address and
the tensors' names, shapes and dtypes in sending order) instead of weight files, then broadcasts the tensors; the
server, asked to load that folder, joins the group (once per trainer session) and receives them in the same
order. Imported by vLLM's worker process: keep its imports to torch, pydantic (vLLM's own), the standard library
and rl.errors.
"""

import json
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist
from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only on Python 3.12+

from rl.errors import TridentError

MANIFEST = "broadcast.json"  # in a weights folder: its tensors come over the process group, not from files


def open_group(manifest: dict, rank: int) -> dist.ProcessGroup:
    """Join the two-rank group that ``manifest`` names as ``rank`` (0: the trainer, which hosts the store).
    Blocks until both ranks are there, at most ``manifest["timeout_s"]``."""
    timeout = timedelta(seconds=manifest["timeout_s"])
    store = dist.TCPStore(
        manifest["host"], manifest["port"], world_size=2, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(manifest["session"], store)
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


class Manifest(TypedDict):
    """What :func:`manifest_for` writes."""

    host: str
    port: Annotated[int, Field(ge=1, le=65535)]
    session: str
    backend: Literal["nccl", "gloo"]
    timeout_s: Annotated[float, Field(gt=0)]
    tensors: list[tuple[str, list[Annotated[int, Field(ge=0)]], str]]


def read_manifest(folder: str | Path) -> dict | None:
    """The broadcast manifest of a weights folder, or None when its weights are files; a ValueError names a
    manifest that is not one."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    text = path.read_bytes()
    try:
        TypeAdapter(Manifest).validate_json(text, strict=True)
    except ValidationError as e:
        raise ValueError(f"{path} is not a broadcast manifest: {e}") from None
    return json.loads(text)


class Sender:
    """The trainer's end of the broadcast (its rank 0 only): one group per trainer process, opened with the first
    send. A send runs in the background until the server asks for those weights (the orchestrator asks for the
    newest); the trainer waits for it before it writes the next weights, so at most one is pending and it is the
    newest. Weights the orchestrator never asks for (it finished first) are left unsent when the trainer exits."""

    def __init__(self, host: str, port: int, timeout_s: float, backend: str, device: torch.device):
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.address = {"host": host, "port": port, "session": uuid.uuid4().hex, "backend": backend}
        self.timeout_s = timeout_s
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.group: dist.ProcessGroup | None = None
        self.pending: threading.Thread | None = None
        self.error: Exception | None = None

    def manifest(self, tensors: dict[str, torch.Tensor]) -> dict:
        return manifest_for(tensors, **self.address, timeout_s=self.timeout_s)

    def send(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start broadcasting ``tensors`` (their manifest already written); :meth:`wait` for it before the next."""
        self.wait()
        self.pending = threading.Thread(target=self._send, args=(tensors,), name="weight-broadcast", daemon=True)
        self.pending.start()

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

    def _send(self, tensors: dict[str, torch.Tensor]) -> None:
        try:
            if self.group is None:
                self.group = open_group(self.manifest({}), rank=0)
            send(self.group, tensors, self.device)
        except RuntimeError as e:  # torch's DistBackendError and store timeouts
            self.error = e
