"""A sparse weight delta: what changed in one tensor between the copy a server serves and the trainer's new value,
in the served dtype, bit for bit; applying it to the served copy gives the new value exactly.

At the learning rates of full fine-tuning most elements of a bf16 weight do not change in a step (an update below
half a bf16 ulp rounds away), so each tensor is encoded in the smallest form of three: nothing (no element
changed), sparse (the changed elements' flat positions and new values) or dense (the whole new tensor, when
storing positions would cost more). Changes are found by comparing raw bits, so -0.0 against 0.0 or a NaN's
payload count as changes and nothing is rounded.

:func:`checksum` gives each tensor a 64-bit number of its raw bytes, cheap enough to run every step on the
device that holds the tensor; :func:`weights_checksum` folds a model's into one. Both the trainer and the server
compute them (``docs/protocol.md``, weight deltas). Torch only: the worker of vLLM imports it.
"""

import hashlib
from typing import Literal, NamedTuple

import torch
from torch import Tensor

Encoding = Literal["none", "sparse", "dense"]
MAX_INT32_INDEX = 2**31 - 1  # a tensor with more elements indexes them as int64
CHECKSUM_CHUNK = 1 << 22  # 16-bit words summed at once: bounds the int64 temporaries to 64 MiB
MASK64 = 2**64 - 1
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer view per element size


class TensorDelta(NamedTuple):
    """One tensor's change, in the served dtype: ``indices`` (flat positions; sparse only) and ``values`` (the new
    values at them, or the whole new tensor flattened when dense); both None when nothing changed."""

    encoding: Encoding
    indices: Tensor | None
    values: Tensor | None

    @property
    def nbytes(self) -> int:
        """The bytes this delta moves."""
        return sum(t.numel() * t.element_size() for t in (self.indices, self.values) if t is not None)


def raw_bits(tensor: Tensor) -> Tensor:
    """``tensor`` flattened and viewed as integers of its element size: equal exactly where the bytes are."""
    return tensor.reshape(-1).view(BITS[tensor.element_size()])


def encode(served: Tensor, trained: Tensor) -> TensorDelta:
    """The delta that turns ``served`` into ``trained`` cast to ``served``'s dtype (same shape).

    Sparse when its positions and values take fewer bytes than the dense tensor: with int32 positions below a third
    of a bf16 tensor's elements changed, below half of a float32's. Naive form::

        new = trained.to(served.dtype).flatten(); changed = (bits(new) != bits(served.flatten())).nonzero()[:, 0]
        none if not len(changed) else sparse(changed, new[changed]) if smaller else dense(new)
    """
    if trained.shape != served.shape:
        raise ValueError(f"a delta needs equal shapes: served {list(served.shape)}, trained {list(trained.shape)}")
    new = trained.detach().to(served.dtype).reshape(-1)
    changed = raw_bits(new) != raw_bits(served.detach())
    count = int(changed.sum())
    if count == 0:
        return TensorDelta("none", None, None)
    numel, size = new.numel(), new.element_size()
    if count * (index_dtype(numel).itemsize + size) < numel * size:
        positions = changed.nonzero()[:, 0]
        return TensorDelta("sparse", positions.to(index_dtype(numel)), new[positions].clone())
    return TensorDelta("dense", None, new.clone())


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a sparse delta's positions in a tensor of ``numel`` elements."""
    return torch.int32 if numel <= MAX_INT32_INDEX else torch.int64


def encode_all(served: dict[str, Tensor], trained: dict[str, Tensor]) -> dict[str, TensorDelta] | None:
    """Each tensor's delta (:func:`encode`) from the ``served`` copy to ``trained``, by name; None when their names,
    shapes or dtypes differ (a full copy is due)."""
    if served.keys() != trained.keys():
        return None
    if any(served[name].shape != t.shape or served[name].dtype != t.dtype for name, t in trained.items()):
        return None
    return {name: encode(served[name], tensor.to(served[name].device)) for name, tensor in trained.items()}


def apply(delta: TensorDelta, served: Tensor) -> None:
    """Turn ``served`` (contiguous) into the new value ``delta`` encodes, in place; a ValueError for a delta of
    another dtype or size."""
    if delta.encoding == "none":
        return
    if delta.values.dtype != served.dtype:
        raise ValueError(f"a delta in {delta.values.dtype} cannot apply to a tensor served in {served.dtype}")
    flat = served.view(-1)
    if delta.encoding == "dense":
        if delta.values.numel() != flat.numel():
            raise ValueError(f"a dense delta of {delta.values.numel()} elements for a tensor of {flat.numel()}")
        flat.copy_(delta.values.to(flat.device))
        return
    flat.index_copy_(0, delta.indices.to(flat.device, torch.int64), delta.values.to(flat.device))


def checksum(tensor: Tensor) -> int:
    """A 64-bit checksum of ``tensor``'s raw bytes: the sum over its 16-bit words (bytes, for 1-byte elements)
    ``w_i`` (unsigned) of ``w_i * (i + 1)``, modulo 2**64.

    Chosen over a hash of the bytes because it runs as torch integer arithmetic on the tensor's own device (a GPU's
    weights never go to the host for it), in about the time of reading them, and its sum is the same in any order.
    A change of one word moves it by ``d * (i + 1)`` with ``0 < |d| < 2**16`` and ``i < 2**47``, never a multiple of
    2**64: any one changed element, and any two elements swapped, change it; several changes escape only if their
    weighted differences cancel modulo 2**64.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    words = flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.uint8)
    mask = 0xFFFF if words.dtype == torch.int16 else 0xFF
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), CHECKSUM_CHUNK):
        chunk = words[start : start + CHECKSUM_CHUNK].to(torch.int64) & mask
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=flat.device)
        total += (chunk * positions).sum()  # int64 arithmetic wraps: the sum modulo 2**64
    return int(total) & MASK64


def weights_checksum(checksums: dict[str, int]) -> str:
    """One checksum of a model's weights from each tensor's (:func:`checksum`), by name: the first 16 hex digits of
    the SHA-256 of ``name:checksum`` lines in name order."""
    lines = "".join(f"{name}:{checksums[name]:016x}\n" for name in sorted(checksums))
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


class WeightsCopy:
    """A model's weights as a server serves them, by name, with each tensor's :func:`checksum`: the copy a trainer
    takes deltas against and a server applies them to (the weights' size once more, wherever its tensors live)."""

    def __init__(self):
        self.tensors: dict[str, Tensor] = {}
        self.checksums: dict[str, int] = {}

    def replace(self, tensors: dict[str, Tensor]) -> None:
        """Make the copy ``tensors`` (kept as given, not copied)."""
        self.tensors = tensors
        self.checksums = {name: checksum(tensor) for name, tensor in tensors.items()}

    def apply(self, deltas: dict[str, TensorDelta]) -> None:
        """Apply each tensor's delta in place; a ValueError naming tensors the copy does not have."""
        if unknown := sorted(deltas.keys() - self.tensors.keys()):
            raise ValueError(f"deltas of tensors the served weights do not have: {', '.join(unknown[:3])}")
        for name, delta in deltas.items():
            if delta.encoding != "none":
                apply(delta, self.tensors[name])
                self.checksums[name] = checksum(self.tensors[name])

    def clear(self) -> None:
        """Hold nothing (the weights came another way, or are about to be replaced)."""
        self.tensors, self.checksums = {}, {}

    @property
    def checksum(self) -> str:
        """Of the whole copy as it is now (:func:`weights_checksum`)."""
        return weights_checksum(self.checksums)


def to_wire(deltas: dict[str, TensorDelta]) -> tuple[list[list], list[Tensor]]:
    """How deltas go over a process group: each tensor's ``[encoding, changed elements]`` in order (sent ahead, as
    JSON), and the tensors broadcast after it, in order: a sparse delta's positions and values, a dense one's values."""
    header, tensors = [], []
    for delta in deltas.values():
        header.append([delta.encoding, 0 if delta.values is None else delta.values.numel()])
        tensors += [t for t in (delta.indices, delta.values) if t is not None]
    return header, tensors


def from_wire(header: list[list], entries: list[list], device: torch.device) -> tuple[dict[str, TensorDelta], list]:
    """The deltas :func:`to_wire` sent for the manifest's tensors ``entries`` (``[name, shape, dtype]``), by name,
    and their tensors in sending order, empty until received into; a ValueError for a header that does not fit."""
    if len(header) != len(entries):
        raise ValueError(f"a delta of {len(header)} tensors for weights of {len(entries)}")
    deltas, tensors = {}, []
    for (encoding, count), (name, shape, dtype) in zip(header, entries, strict=True):
        numel, dtype = torch.Size(shape).numel(), getattr(torch, dtype)
        if encoding not in ("none", "sparse", "dense") or (encoding == "dense" and count != numel) or count > numel:
            raise ValueError(f"tensor {name}: {encoding!r} of {count} elements is not a delta of {numel}")
        indices = torch.empty(count, dtype=index_dtype(numel), device=device) if encoding == "sparse" else None
        values = None if encoding == "none" else torch.empty(count, dtype=dtype, device=device)
        deltas[name] = TensorDelta(encoding, indices, values)
        tensors += [t for t in (indices, values) if t is not None]
    return deltas, tensors


def to_tensors(deltas: dict[str, TensorDelta]) -> dict[str, Tensor]:
    """The deltas of a model as named tensors for a safetensors file: ``<name>:indices`` and ``<name>:values`` for
    a sparse one, ``<name>:dense`` for a dense one, nothing for an unchanged one."""
    tensors = {}
    for name, delta in deltas.items():
        if delta.encoding == "sparse":
            tensors[f"{name}:indices"], tensors[f"{name}:values"] = delta.indices, delta.values
        elif delta.encoding == "dense":
            tensors[f"{name}:dense"] = delta.values
    return tensors


def from_tensors(tensors: dict[str, Tensor]) -> dict[str, TensorDelta]:
    """The deltas :func:`to_tensors` wrote, by tensor name (unchanged tensors are absent); a ValueError names a key
    that is not one of them."""
    deltas = {}
    for key, tensor in tensors.items():
        name, _, part = key.rpartition(":")
        if part == "dense":
            deltas[name] = TensorDelta("dense", None, tensor)
        elif part == "indices" and f"{name}:values" in tensors:
            deltas[name] = TensorDelta("sparse", tensor, tensors[f"{name}:values"])
        elif part != "values" or f"{name}:indices" not in tensors:
            raise ValueError(f"{key!r} is not a weight delta's tensor (<name>:indices with :values, or :dense)")
    return deltas
