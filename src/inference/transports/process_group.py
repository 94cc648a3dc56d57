"""Weights received from the trainer's memory over a two-rank group of the worker's own with the trainer (the trainer
rank 0, the worker rank 1; NCCL between GPUs, gloo otherwise), asked for through the trainer's store."""

import json
import uuid
from typing import Any

import torch
import torch.distributed as dist

from contracts.weight_delta import WeightsCopy, from_wire
from contracts.weight_manifest import DELTA, SEND, answer_key, ask_key, asks_key
from contracts.weight_wire import RECEIVER_RANK, broadcast, connect_store, pair_group
from inference.transports.base import WeightReceiver


class ProcessGroupReceiver(WeightReceiver):
    """One per trainer session: it asks the trainer for the weights a manifest names and receives them over its
    own group with the trainer (made at the first ask the trainer answers).

    For weights that may come as deltas (their manifest has a ``checksum``: ``[weights] delta``) it keeps a copy
    of the weights it loaded last on the receiving device (the weights' size once more), tells the trainer their
    sequence and checksum with each ask, and applies the deltas the trainer then sends to it; the full weights
    replace it otherwise. Until vLLM has loaded them it holds nothing, so a load that fails half way is followed
    by full weights."""

    def __init__(self, manifest: dict):
        self.name = uuid.uuid4().hex
        self.session = manifest["session"]
        self.store = connect_store(manifest)
        self.group: dist.ProcessGroup | None = None
        self.served = WeightsCopy()  # the copy deltas apply to
        self.held: tuple[int, str] | None = None  # (sequence, checksum) of the copy, once vLLM loaded it
        self.pending: tuple[int, str] | None = None

    def forget(self) -> None:
        """The model's weights came another way: the copy no longer says what is served."""
        self.served.clear()
        self.held = None

    def receive(self, path: str, manifest: dict) -> dict[str, Any] | None:
        nccl = manifest["backend"] == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        tensors = self.take(manifest, device)
        return None if tensors is None else {"weights_iterator": iter(tensors)}

    def loaded(self, manifest: dict) -> None:
        """The copy is what the server serves now (the trainer counts the weights taken once it sent them)."""
        self.held = self.pending

    def served_checksum(self) -> str | None:
        return None if self.held is None else self.held[1]

    def take(self, manifest: dict, device: torch.device) -> list[tuple[str, torch.Tensor]] | None:
        """The manifest's tensors, in its order onto ``device``; None when the trainer no longer holds them."""
        deltas = "checksum" in manifest
        held, self.held = self.held, None  # until vLLM has loaded what comes
        ask = self.store.add(asks_key(self.session), 1)
        self.store.set(ask_key(self.session, ask), json.dumps([self.name, manifest["sequence"], held]))
        self.store.wait([answer_key(self.session, ask)])
        answer = self.store.get(answer_key(self.session, ask))
        if answer != SEND and not answer.startswith(DELTA):
            self.held = held  # nothing changed
            return None
        if self.group is None:
            self.group = pair_group(manifest, RECEIVER_RANK, self.name)
        if answer.startswith(DELTA):
            changes, tensors = from_wire(json.loads(answer.removeprefix(DELTA)), manifest["tensors"], device)
            receive_into(self.group, tensors)
            self.served.apply(changes)
            received = list(self.served.tensors.items())
        else:
            self.served.clear()
            received = receive_over(self.group, manifest, device)
            if deltas:
                self.served.replace(dict(received))
        if deltas:
            self.pending = (manifest["sequence"], self.served.checksum)
        return received


def receive_into(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Receive into ``tensors``, in their order, over ``group``."""
    for tensor in tensors:
        broadcast(group, tensor)


def receive_over(group: dist.ProcessGroup, manifest: dict, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The manifest's tensors, received over ``group`` in its order onto ``device``."""
    received = [
        (name, torch.empty(shape, dtype=getattr(torch, dtype), device=device))
        for name, shape, dtype in manifest["tensors"]
    ]
    receive_into(group, [tensor for _, tensor in received])
    return received
