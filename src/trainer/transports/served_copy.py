"""The trainer's copy of the weights it broadcast last (``[weights] delta`` over ``[weight_broadcast]``): what each
step's deltas are taken against, and the checksum a server that holds them reports (docs/protocol.md)."""

from typing import Literal, NamedTuple

from torch import Tensor

from contracts.weight_delta import TensorDelta, apply, checksum, encode_all, weights_checksum


class Change(NamedTuple):
    """What turns the weights sent before into the newest: ``deltas`` (by name, in the manifest's order) against
    the weights ``base`` (their sequence and checksum); both None when only a full copy gives them."""

    base: tuple[int, str] | None
    deltas: dict[str, TensorDelta] | None


class ServedCopy:
    """The weights sent last in the served dtype, in host memory (their size once more, the memory plan's
    ``delta_copy``), their sequence and checksum. A full copy for the first weights, every ``full_every`` sequences,
    when the tensors' names, shapes or dtype change, and under ``auto`` when the deltas would be over half a full
    copy's bytes: each server then gets the full weights, even one that holds the previous ones."""

    def __init__(self, mode: Literal["on", "auto"], full_every: int):
        self.mode, self.full_every = mode, full_every
        self.tensors: dict[str, Tensor] | None = None
        self.checksums: dict[str, int] = {}
        self.sequence = self.full_sequence = 0
        self.checksum = ""  # of the copy

    def update(self, tensors: dict[str, Tensor], sequence: int) -> Change:
        """Make the copy ``tensors`` (weights ``sequence``); what turns the copy before into them."""
        deltas = None
        if self.tensors is not None and sequence - self.full_sequence < self.full_every:
            deltas = encode_all(self.tensors, tensors)
        if deltas is not None and self.mode == "auto":
            size = sum(delta.nbytes for delta in deltas.values())
            if 2 * size > sum(t.numel() * t.element_size() for t in self.tensors.values()):
                deltas = None
        base = None if deltas is None else (self.sequence, self.checksum)
        if deltas is None:
            self.tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
            self.checksums = {name: checksum(tensor) for name, tensor in self.tensors.items()}
            self.full_sequence = sequence
        else:
            for name, delta in deltas.items():
                if delta.encoding != "none":
                    apply(delta, self.tensors[name])
                    self.checksums[name] = checksum(self.tensors[name])
        self.sequence, self.checksum = sequence, weights_checksum(self.checksums)
        return Change(base, deltas)
