"""Weights as files that hold only what changed (``[weights] delta``): each step's folder a delta against the
previous step's weights, a full copy to start the chain and to compact it (``contracts.delta_chain``)."""

from pathlib import Path
from typing import Literal

from safetensors.torch import save_file
from torch import Tensor

from contracts.delta_chain import DELTA_WEIGHTS, DeltaInfo, write_delta_info
from contracts.weight_delta import apply, checksum, encode_all, to_tensors, weights_checksum
from trainer.transports.base import ExportedWeights, WeightSender
from trainer.transports.files import FileSender


class DeltaFileSender(WeightSender):
    """Writes each step's full weights as a delta against the weights it wrote the step before, keeping a copy of
    those (the served copy, in the served dtype, in rank 0's host memory: the weights' size once more) to diff
    against.

    A full copy instead for the first weights it writes, every ``full_every`` steps, once the chain's deltas since
    the last full copy would hold more bytes than one (a server that replays the chain then reads at most about two
    full copies), when the tensors' names, shapes or dtype change, and under ``auto`` whenever the delta would hold
    over half a full copy's bytes."""

    def __init__(self, mode: Literal["on", "auto"], full_every: int):
        self.mode, self.full_every = mode, full_every
        self.files = FileSender()
        self.weights: ExportedWeights | None = None  # sent, not yet written
        self.served: dict[str, Tensor] | None = None  # the weights written last, as the servers hold them
        self.served_checksums: dict[str, int] = {}
        self.served_step = self.full_step = 0
        self.chain_bytes = 0  # of the deltas since the full copy
        self.last: DeltaInfo | None = None  # what the folder written last holds

    def send(self, weights: ExportedWeights) -> None:
        self.weights = weights

    def write(self, folder: Path) -> None:
        weights, self.weights = self.weights, None
        tensors = {name: tensor.contiguous() for name, tensor in weights.tensors.items()}
        deltas = self.deltas(tensors, weights.step)
        if deltas is None:
            self.files.send(weights._replace(tensors=tensors))
            self.files.write(folder)
            self.served, self.full_step, self.chain_bytes = tensors, weights.step, 0
            self.served_checksums = {name: checksum(tensor) for name, tensor in tensors.items()}
            base = None
        else:
            save_file(to_tensors(deltas), Path(folder) / DELTA_WEIGHTS)
            for name, delta in deltas.items():
                if delta.encoding != "none":
                    apply(delta, self.served[name])
                    self.served_checksums[name] = checksum(self.served[name])
            self.chain_bytes += sum(delta.nbytes for delta in deltas.values())
            base = (self.served_step, self.last.checksum)
        self.served_step = weights.step
        self.last = DeltaInfo(
            step=weights.step,
            kind="full" if base is None else "delta",
            full_step=self.full_step,
            base_step=None if base is None else base[0],
            base_checksum=None if base is None else base[1],
            checksum=weights_checksum(self.served_checksums),
            dtype=str(weights.dtype).removeprefix("torch."),
        )
        write_delta_info(folder, self.last)

    def deltas(self, tensors: dict[str, Tensor], step: int) -> dict | None:
        """Each tensor's delta against the served copy, or None where a full copy is due."""
        served = self.served
        if served is None or step - self.full_step >= self.full_every:
            return None
        deltas = encode_all(served, tensors)
        if deltas is None:
            return None
        size, full = sum(d.nbytes for d in deltas.values()), sum(t.numel() * t.element_size() for t in served.values())
        if self.chain_bytes + size > full or (self.mode == "auto" and 2 * size > full):
            return None
        return deltas
