"""Weights as files that hold only what changed (``[weights] delta``): each step's folder a delta against the
previous step's weights, a full copy to start the chain and to compact it (``contracts.delta_chain``)."""

from pathlib import Path
from typing import Literal

from safetensors.torch import save_file

from contracts.delta_chain import DELTA_WEIGHTS, DeltaInfo, write_delta_info
from contracts.weight_delta import to_tensors
from trainer.transports.base import ExportedWeights, WeightSender
from trainer.transports.files import FileSender
from trainer.transports.served_copy import ServedCopy


class DeltaFileSender(WeightSender):
    """Writes each step's full weights as a delta against the weights it wrote the step before, keeping a copy of
    those (``ServedCopy``, in rank 0's host memory) to diff against: a full copy where that copy says one is due,
    and once the chain's deltas since the last full copy would hold more bytes than one."""

    def __init__(self, mode: Literal["on", "auto"], full_every: int):
        self.served = ServedCopy(mode, full_every, chain_limit=True)
        self.files = FileSender()
        self.weights: ExportedWeights | None = None  # sent, not yet written
        self.last: DeltaInfo | None = None  # what the folder written last holds

    def send(self, weights: ExportedWeights) -> None:
        self.weights = weights

    def write(self, folder: Path) -> None:
        weights, self.weights = self.weights, None
        tensors = {name: tensor.contiguous() for name, tensor in weights.tensors.items()}
        base, deltas = self.served.update(tensors, weights.step, copy=False)  # exported for this folder alone
        if deltas is None:
            self.files.send(weights._replace(tensors=tensors))
            self.files.write(folder)
        else:
            save_file(to_tensors(deltas), Path(folder) / DELTA_WEIGHTS)
        self.last = DeltaInfo(
            step=weights.step,
            kind="full" if base is None else "delta",
            full_step=self.served.full_sequence,
            base_step=None if base is None else base[0],
            base_checksum=None if base is None else base[1],
            checksum=self.served.checksum,
            dtype=str(weights.dtype).removeprefix("torch."),
        )
        write_delta_info(folder, self.last)
