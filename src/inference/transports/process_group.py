"""Weights received from the trainer's memory over a two-rank group of the worker's own with the trainer (the trainer
rank 0, the worker rank 1; NCCL between GPUs, gloo otherwise), asked for through the trainer's store."""

import json
import uuid
from typing import Any

import torch
import torch.distributed as dist

from contracts.weight_manifest import SEND, answer_key, ask_key, asks_key
from contracts.weight_wire import RECEIVER_RANK, broadcast, connect_store, pair_group
from inference.transports.base import WeightReceiver


class ProcessGroupReceiver(WeightReceiver):
    """One per trainer session: it asks the trainer for the weights a manifest names and receives them over its
    own group with the trainer (made at the first ask the trainer answers)."""

    def __init__(self, manifest: dict):
        self.name = uuid.uuid4().hex
        self.session = manifest["session"]
        self.store = connect_store(manifest)
        self.group: dist.ProcessGroup | None = None

    def receive(self, path: str, manifest: dict) -> dict[str, Any] | None:
        nccl = manifest["backend"] == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        tensors = self.take(manifest, device)
        return None if tensors is None else {"weights_iterator": iter(tensors)}

    def loaded(self, manifest: dict) -> None:
        """Nothing to tell: the trainer counts the weights taken once it has sent the last tensor."""

    def take(self, manifest: dict, device: torch.device) -> list[tuple[str, torch.Tensor]] | None:
        """The manifest's tensors, in its order onto ``device``; None when the trainer no longer holds them."""
        ask = self.store.add(asks_key(self.session), 1)
        self.store.set(ask_key(self.session, ask), json.dumps([self.name, manifest["sequence"]]))
        self.store.wait([answer_key(self.session, ask)])
        if self.store.get(answer_key(self.session, ask)) != SEND:
            return None
        if self.group is None:
            self.group = pair_group(manifest, RECEIVER_RANK, self.name)
        return receive_over(self.group, manifest, device)


def receive_over(group: dist.ProcessGroup, manifest: dict, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The manifest's tensors, received over ``group`` in its order onto ``device``."""
    received = []
    for name, shape, dtype in manifest["tensors"]:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        broadcast(group, tensor)
        received.append((name, tensor))
    return received
