"""The trainer's copy of the weights it sent last when deltas are on (``[weights] delta``): what each step's deltas
are taken against, and the checksum a server that holds them reports (docs/protocol.md). Both ways of sending
weights as deltas keep one: over files (``delta_files``) and over the broadcast (``process_group``)."""

from typing import Literal, NamedTuple

from torch import Tensor

from contracts.weight_delta import TensorDelta, WeightsCopy, encode_all


class Change(NamedTuple):
    """What turns the weights sent before into the newest: ``deltas`` (by name, in the manifest's order) against
    the weights ``base`` (their sequence and checksum); both None when only a full copy gives them."""

    base: tuple[int, str] | None
    deltas: dict[str, TensorDelta] | None


class ServedCopy:
    """The weights sent last in the served dtype, in host memory (their size once more, the memory plan's
    ``delta_copy``), their sequence and checksum, and the sequence of the last full copy.

    A full copy is due for the first weights, every ``full_every`` sequences, when the tensors' names, shapes or
    dtype change, under ``auto`` when the deltas would be over half a full copy's bytes, and with ``chain_limit``
    when the deltas since the last full copy would hold more bytes than one (a server replaying the chain from its
    full copy then reads at most about two): each server then gets the full weights, even one that holds the
    previous ones."""

    def __init__(self, mode: Literal["on", "auto"], full_every: int, chain_limit: bool = False):
        self.mode, self.full_every, self.chain_limit = mode, full_every, chain_limit
        self.copy = WeightsCopy()
        self.sequence = self.full_sequence = 0
        self.chain_bytes = 0  # of the deltas since the full copy

    @property
    def checksum(self) -> str:
        """Of the weights sent last."""
        return self.copy.checksum

    def update(self, tensors: dict[str, Tensor], sequence: int, copy: bool = True) -> Change:
        """Make the copy ``tensors`` (weights ``sequence``); what turns the copy before into them. ``copy=False``:
        host tensors the caller hands over (not used after) become the copy as they are at a full copy."""
        deltas = self.deltas(tensors, sequence)
        base = None if deltas is None else (self.sequence, self.checksum)
        if deltas is None:
            self.copy.clear()  # before the new copy: the weights' size once more at most
            if copy:
                tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
            self.copy.replace(tensors)
            self.full_sequence, self.chain_bytes = sequence, 0
        else:
            self.copy.apply(deltas)
            self.chain_bytes += sum(delta.nbytes for delta in deltas.values())
        self.sequence = sequence
        return Change(base, deltas)

    def deltas(self, tensors: dict[str, Tensor], sequence: int) -> dict[str, TensorDelta] | None:
        """Each tensor's delta against the copy, or None where a full copy is due."""
        if not self.copy.tensors or sequence - self.full_sequence >= self.full_every:
            return None
        deltas = encode_all(self.copy.tensors, tensors)
        if deltas is None:
            return None
        size = sum(delta.nbytes for delta in deltas.values())
        full = sum(t.numel() * t.element_size() for t in self.copy.tensors.values())
        if (self.mode == "auto" and 2 * size > full) or (self.chain_limit and self.chain_bytes + size > full):
            return None
        return deltas
