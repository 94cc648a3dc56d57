"""The trainer's weight senders: files, or in memory over a process group or a shared buffer
(``[weight_broadcast]``)."""

import torch

from trainer.transports.base import MemorySender
from trainer.transports.process_group import ProcessGroupSender
from trainer.transports.shared_buffer import SharedBufferSender


def memory_sender(
    host: str,
    port: int,
    timeout_s: float,
    backend: str,
    device: torch.device,
    receivers: int = 1,
    delta: str = "off",
    full_every: int = 1,
) -> MemorySender:
    """The sender of ``[weight_broadcast]``'s ``backend`` through the store at ``host:port`` (``auto``: NCCL on a
    GPU, gloo otherwise), for ``receivers`` servers, sending deltas as ``[weights] delta`` says (a process group's
    only); rank 0's, made before the first send."""
    if backend == "shared":
        return SharedBufferSender(host, port, timeout_s, device)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return ProcessGroupSender(host, port, timeout_s, backend, device, receivers, delta, full_every)
