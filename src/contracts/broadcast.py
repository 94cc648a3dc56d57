"""Weights sent from the trainer to its inference servers in memory: over one TCP store the trainer hosts, a two-rank
process group of its own with each server's worker (the trainer rank 0, the worker rank 1), NCCL between GPUs and
gloo otherwise, so a server that dies or comes back breaks or holds up no other; or, for a trainer and one server on
one device, a buffer both map (``backend = "shared"``, :mod:`contracts.shared_weights`: CUDA IPC on a GPU,
``/dev/shm`` on the CPU), the store then only carrying the server's word that it took the weights.

The trainer writes ``weights/step_N/`` as usual but with a manifest (:data:`MANIFEST`: the store's address, the
weights' sequence number in the trainer session and the tensors' names, shapes and dtypes in sending order, and for a
shared buffer its handle and their offsets) instead of weight files, and holds the weights; a server asked to load
that folder asks the trainer for them through the store (:class:`Receiver`) and receives them in the same order over
its group (made at its first ask of the session), or copies them from the buffer. Imported by vLLM's worker process:
keep its imports to torch, pydantic (vLLM's own), the standard library and contracts.errors.
"""

import itertools
import json
import logging
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

logger = logging.getLogger("trainer")  # only the trainer's Sender logs

MANIFEST = "broadcast.json"  # in a weights folder: its tensors come over the process group, not from files
SEND = b"send"  # the trainer's answer to an ask for the weights it holds


def open_group(manifest: dict, rank: int, receiver: str) -> dist.ProcessGroup:
    """Join the two-rank group of the trainer (rank 0) and ``receiver`` (a server's worker, rank 1) in the session
    ``manifest`` names, over a connection of its own to the trainer's store (hosted already). Blocks until both
    ranks are there, at most ``manifest["timeout_s"]``."""
    timeout = timedelta(seconds=manifest["timeout_s"])
    prefixed = dist.PrefixStore(f"{manifest['session']}/{receiver}", open_store(manifest))
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


def open_store(manifest: dict, hosting: bool = False) -> dist.TCPStore:
    """A connection to the trainer's TCP store that ``manifest`` names; ``hosting``: the trainer's, which hosts the
    store, listening on that host only. One connection serves one thread at a time (a wait holds it)."""
    host, port = manifest["host"], manifest["port"]
    listening = {"master_listen_fd": listen(host, port)} if hosting else {}
    timeout = timedelta(seconds=manifest["timeout_s"])
    return dist.TCPStore(host, port, is_master=hosting, timeout=timeout, wait_for_workers=False, **listening)


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


def ask_key(session: str, ask: int) -> str:
    """The store key of a receiver's ``ask``-th ask of the session (numbered from 1 by the store's counter)."""
    return f"{session}/ask/{ask}"


def answer_key(session: str, ask: int) -> str:
    """The store key of the trainer's answer to that ask: :data:`SEND`, or why it cannot."""
    return f"{session}/answer/{ask}"


def manifest_for(
    tensors: dict[str, torch.Tensor], host: str, port: int, session: str, backend: str, timeout_s: float, sequence=1
) -> dict:
    """The manifest of a broadcast of ``tensors``, the trainer session ``session``'s weights number ``sequence``,
    through the store at ``host:port``."""
    return {
        "host": host,
        "port": port,
        "session": session,
        "backend": backend,
        "timeout_s": timeout_s,
        "sequence": sequence,
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
    sequence: Annotated[int, Field(ge=1)]
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


class Receiver:
    """An inference server worker's end of a gloo or NCCL broadcast, one per trainer session: it asks the trainer
    for the weights a manifest names and receives them over its own group with the trainer (made at the first)."""

    def __init__(self, manifest: dict):
        self.name = uuid.uuid4().hex
        self.session = manifest["session"]
        self.store = open_store(manifest)
        self.group: dist.ProcessGroup | None = None

    def receive(self, manifest: dict, device: torch.device) -> list[tuple[str, torch.Tensor]] | None:
        """The manifest's tensors, in its order onto ``device``; None when the trainer no longer holds them (it has
        sent newer weights since)."""
        ask = self.store.add(f"{self.session}/asks", 1)
        self.store.set(ask_key(self.session, ask), json.dumps([self.name, manifest["sequence"]]))
        self.store.wait([answer_key(self.session, ask)])
        if self.store.get(answer_key(self.session, ask)) != SEND:
            return None
        if self.group is None:
            self.group = open_group(manifest, 1, self.name)
        return receive(self.group, manifest, device)


class Sender:
    """The trainer's end (its rank 0 only), made with the first send. For gloo and NCCL it hosts the store and holds
    the newest weights until newer ones are sent, sending them to each server that asks (:class:`Receiver`) over a
    group of their own, several at once; the orchestrator has every server load the newest, and a server that comes
    back asks again. Before newer weights replace them, the trainer waits until as many servers took them as took
    the weights before (``receivers`` the first time), at most ``timeout_s``: a server that left costs one such wait
    and is then no longer waited for; one that comes back counts again once it took weights. A shared buffer serves
    one server: a send goes on in the background until that server has taken the weights, and the trainer waits for
    it before it writes the next. Weights the orchestrator never asks for (it finished first) are left untaken when
    the trainer exits."""

    def __init__(self, host: str, port: int, timeout_s: float, backend: str, device: torch.device, receivers: int = 1):
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.address = {"host": host, "port": port, "session": uuid.uuid4().hex, "backend": backend}
        self.timeout_s = timeout_s
        self.device = device if backend in ("nccl", "shared") else torch.device("cpu")
        self.receivers = receivers  # how many servers must take the newest weights before newer replace them
        self.store: dist.TCPStore | None = None
        self.buffer: SharedBuffer | None = None
        self.sequence = 0  # how many weights were sent (or written into the shared buffer)
        self.newest: dict[str, torch.Tensor] = {}
        self.takers: set[str] = set()  # receivers that took the newest weights
        self.groups: dict[str, dist.ProcessGroup] = {}  # each receiver's, by name
        self.changed = threading.Condition()  # guards newest, sequence, takers, groups and error
        self.serving: threading.Thread | None = None  # answers the servers' asks, from the first send to close
        self.pending: threading.Thread | None = None  # a shared buffer's wait for the server to take the weights
        self.error: Exception | None = None

    def manifest(self, tensors: dict[str, torch.Tensor]) -> dict:
        return manifest_for(tensors, **self.address, timeout_s=self.timeout_s, sequence=max(self.sequence, 1))

    def send(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Hold ``tensors`` as the newest weights (a shared buffer holds them when this returns), sent to each server
        that asks; returns the manifest for their weights folder. Waits for the previous ones first (:meth:`wait`)."""
        self.wait()
        if self.address["backend"] == "shared":
            manifest = self._share(tensors)
            self.pending = threading.Thread(target=self._run, args=(self._await_taken, manifest), daemon=True)
            self.pending.start()
            return manifest
        if self.serving is None:
            try:
                self.store = open_store(self.manifest({}), hosting=True)
            except (RuntimeError, OSError) as e:  # the port taken
                raise self.failure(e) from None
            self.serving = threading.Thread(target=self._run, args=(self._serve,), name="weight-broadcast", daemon=True)
            self.serving.start()
        with self.changed:
            self.newest, self.takers, self.sequence = tensors, set(), self.sequence + 1
        return self.manifest(tensors)

    def wait(self) -> None:
        """Block until the newest weights were taken by as many servers as :meth:`send` says, at most ``timeout_s``
        (a shared buffer's: by its server); raise if none took them or the store failed."""
        if self.address["backend"] == "shared":
            if self.pending is not None:
                self.pending.join()
                self.pending = None
        elif self.sequence:
            self._await_receivers()
        if self.error is not None:
            raise self.failure(self.error)

    def failure(self, error: Exception) -> TridentError:
        address = f"{self.address['host']}:{self.address['port']}"
        return TridentError(
            f"weight broadcast ({self.address['backend']}, store {address}) failed: the inference server did not "
            f"receive the weights within weight_broadcast.timeout_s = {self.timeout_s:.0f}s, or left ({error})"
        )

    def _await_receivers(self) -> None:
        """Wait until ``receivers`` servers took the newest weights, at most ``timeout_s``; then expect as many as
        took them."""
        with self.changed:
            enough = self.changed.wait_for(
                lambda: len(self.takers) >= self.receivers or self.error is not None, self.timeout_s
            )
            if not enough and self.takers:
                logger.warning(
                    f"weight broadcast: {len(self.takers)} of {self.receivers} inference servers took weights "
                    f"{self.sequence} within weight_broadcast.timeout_s = {self.timeout_s:.0f}s; going on without "
                    "waiting for the others (one that comes back gets newer weights when it asks)"
                )
            elif not enough:
                self.error = TimeoutError("no server asked for them")
            self.receivers = len(self.takers) or self.receivers

    def close(self) -> None:
        """Stop answering servers (a thread blocked in the store when the process exits aborts it: the last ask
        ends it) and release the shared buffer (its ``/dev/shm`` file goes); the servers keep what they took."""
        if self.serving is not None:
            session, store = self.address["session"], open_store(self.manifest({}))  # the serving thread holds its own
            store.set(ask_key(session, store.add(f"{session}/asks", 1)), "null")
            self.serving.join()
            self.serving = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    def _run(self, work, *args) -> None:
        try:
            work(*args)
        except (RuntimeError, OSError) as e:  # torch's DistBackendError and store timeouts; the port taken
            with self.changed:
                self.error = e
                self.changed.notify_all()

    def _serve(self) -> None:
        """Answer each receiver's ask, in turn: send it the newest weights (in a thread of their own), or tell it
        that the weights it asks for were replaced by newer ones; until the ask :meth:`close` makes."""
        session = self.address["session"]
        for ask in itertools.count(1):
            while True:
                try:
                    self.store.wait([ask_key(session, ask)], timedelta(days=1))
                    break
                except dist.DistStoreError:  # a day without an ask: wait on
                    continue
            request = json.loads(self.store.get(ask_key(session, ask)))
            if request is None:
                return
            name, sequence = request
            with self.changed:
                newest, current = self.newest, self.sequence
            if sequence != current:
                self.store.set(answer_key(session, ask), f"the trainer holds weights {current}, not {sequence}")
                continue
            self.store.set(answer_key(session, ask), SEND)
            threading.Thread(target=self._send_to, args=(name, newest, sequence), daemon=True).start()

    def _send_to(self, name: str, tensors: dict[str, torch.Tensor], sequence: int) -> None:
        """Send ``tensors`` (weights ``sequence``) to receiver ``name`` over its group (made at its first ask); a
        receiver that leaves meanwhile is let go with a warning."""
        try:
            group = self.groups.get(name) or open_group(self.manifest({}), 0, name)
            send(group, tensors, self.device)
        except (RuntimeError, OSError) as e:
            with self.changed:
                self.groups.pop(name, None)
            logger.warning(f"weight broadcast: an inference server left while it received weights {sequence} ({e})")
            return
        with self.changed:
            self.groups[name] = group
            if sequence == self.sequence:
                self.takers.add(name)
                self.changed.notify_all()

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
            self.store = open_store(manifest, hosting=True)
        self.store.wait([taken_key(manifest)])
        self.buffer.unlink()  # the server has mapped it for the session: no file is left behind if either dies
