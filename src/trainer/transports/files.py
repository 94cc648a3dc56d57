"""Weights as files: HF safetensors in their weights folder (a LoRA adapter alone in peft's format), which any
server loads from the folder."""

import json
from pathlib import Path

import torch

from trainer.transports.base import ExportedWeights, WeightSender


class FileSender(WeightSender):
    """Writes each step's weights into their folder."""

    def __init__(self):
        self.weights: ExportedWeights | None = None  # sent, not yet written

    def send(self, weights: ExportedWeights) -> None:
        self.weights = weights

    def write(self, folder: Path) -> None:
        weights, self.weights = self.weights, None
        weights.owner.save_pretrained(folder, state_dict=weights.tensors)  # a PeftModel saves its adapter's only
        if weights.dtype is not None:
            set_config_dtype(folder, weights.dtype)


def set_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    """Record ``dtype`` as the weights' dtype in ``folder``'s config.json (a server's ``dtype = auto`` reads it)."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2) + "\n")
