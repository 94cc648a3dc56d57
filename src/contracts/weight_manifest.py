"""What the trainer and an inference server agree on when weights come from the trainer's memory instead of files:
the manifest a weights folder then holds (:data:`MANIFEST`), the names both use in the trainer's store, and where
each tensor lies in a shared buffer. The transports themselves are the trainer's senders (``trainer/transports/``)
and the server's receivers (``inference/transports/``); what both ends run alike is in :mod:`contracts.weight_wire`.

A manifest names the trainer's store (host, port), its session (one per trainer process), the backend (``gloo``,
``nccl`` or ``shared``), the weights' sequence number in the session and the tensors' names, shapes and dtypes in
sending order; for a shared buffer also the buffer's handle and each tensor's byte offset. A folder without one
holds its weights as files. Imported by vLLM's worker process: keep its imports to pydantic (vLLM's own) and the
standard library.
"""

import json
import re
from pathlib import Path
from typing import Annotated, Literal, NotRequired

from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only on Python 3.12+

MANIFEST = "broadcast.json"  # in a weights folder: its tensors come from the trainer's memory, not from files
SEND = b"send"  # the trainer's answer to an ask for the weights it holds: their full copy follows
DELTA = b"delta "  # ... or (``[weights] delta``): each tensor's delta against the receiver's copy follows, as
# this prefix and then the JSON list of each tensor's ``[encoding, changed elements]`` says (docs/protocol.md)

SHM_DIR = Path("/dev/shm")
SHM_NAME = re.compile(r"trident-weights-[0-9a-f]{32}")  # the only files a worker maps
ALIGN = 256  # bytes: each tensor starts at a multiple in a shared buffer, as CUDA kernels and every dtype's view want
CUDA_HANDLE_FIELDS = ("device", "handle", "size", "offset", "ref_counter", "ref_counter_offset", "event", "event_sync")
CUDA_HANDLE_BYTES = ("handle", "ref_counter", "event")  # the fields a CUDA IPC handle carries in base64


def manifest_for(
    tensors: dict,
    host: str,
    port: int,
    session: str,
    backend: str,
    timeout_s: float,
    sequence: int = 1,
    checksum: str | None = None,
) -> dict:
    """The manifest of a broadcast of ``tensors``, the trainer session ``session``'s weights number ``sequence``,
    through the store at ``host:port``; with the ``checksum`` of the weights (``contracts.weight_delta``) when they
    may come as deltas (``[weights] delta``)."""
    return {
        "host": host,
        "port": port,
        "session": session,
        "backend": backend,
        "timeout_s": timeout_s,
        "sequence": sequence,
        "tensors": [[name, list(t.shape), dtype_name(t)] for name, t in tensors.items()],
    } | ({"checksum": checksum} if checksum else {})


def layout(tensors: dict) -> tuple[list[list], int]:
    """Where each tensor lies in a shared buffer: ``[name, shape, dtype, offset]`` in order, and the buffer's size."""
    entries, offset = [], 0
    for name, tensor in tensors.items():
        entries.append([name, list(tensor.shape), dtype_name(tensor), offset])
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return entries, offset


def dtype_name(tensor) -> str:
    """A tensor's dtype as a manifest writes it (``float32``, ``bfloat16``, ...)."""
    return str(tensor.dtype).removeprefix("torch.")


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
    checksum: NotRequired[str]  # with [weights] delta: of the weights, in the served dtype (contracts.weight_delta)


class SharedManifest(TypedDict):
    """What the trainer writes for a shared buffer: the buffer's handle and each tensor's byte offset."""

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


def asks_key(session: str) -> str:
    """The store's counter of the receivers' asks in ``session``."""
    return f"{session}/asks"


def ask_key(session: str, ask: int) -> str:
    """The store key of a receiver's ``ask``-th ask of the session (numbered from 1 by :func:`asks_key`'s counter):
    ``[its name, the manifest's sequence, the [sequence, checksum] of the copy it holds or null]``, or ``null`` when
    the trainer stops answering."""
    return f"{session}/ask/{ask}"


def answer_key(session: str, ask: int) -> str:
    """The store key of the trainer's answer to that ask: :data:`SEND`, or why it cannot."""
    return f"{session}/answer/{ask}"


def taken_key(manifest: dict) -> str:
    """The store key the server sets once it has copied a shared buffer's weights out."""
    return f"{manifest['session']}/taken/{manifest['sequence']}"


def group_prefix(session: str, receiver: str) -> str:
    """The store prefix under which the trainer and the receiver named ``receiver`` make their two-rank group."""
    return f"{session}/{receiver}"


def shm_path(session: str) -> Path:
    """The ``/dev/shm`` file of a trainer session's shared buffer on the CPU (one :data:`SHM_NAME` matches)."""
    return SHM_DIR / f"trident-weights-{session}"
