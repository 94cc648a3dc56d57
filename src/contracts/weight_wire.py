"""What both ends of an in-memory weight transport run alike, so that they meet: a connection to the trainer's
store, the two-rank group of the trainer (rank 0) and one server's worker (rank 1), NCCL between GPUs and gloo
otherwise, the broadcast from the trainer over it, and the tensors a shared buffer's bytes hold. The manifest and the
store's keys are :mod:`contracts.weight_manifest`'s. Imported by vLLM's worker process: keep its imports to torch,
the standard library and contracts.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from contracts.weight_manifest import ALIGN, group_prefix

TRAINER_RANK, RECEIVER_RANK = 0, 1


def connect_store(manifest: dict) -> dist.TCPStore:
    """A connection of its own to the trainer's store that ``manifest`` names (the trainer hosts it). One connection
    serves one thread at a time (a wait holds it)."""
    timeout = timedelta(seconds=manifest["timeout_s"])
    return dist.TCPStore(manifest["host"], manifest["port"], is_master=False, timeout=timeout, wait_for_workers=False)


def pair_group(manifest: dict, rank: int, receiver: str) -> dist.ProcessGroup:
    """Join the two-rank group of the trainer and ``receiver`` (a server's worker) in the session ``manifest`` names,
    over a connection of its own to the trainer's store. Blocks until both ranks are there, at most
    ``manifest["timeout_s"]``."""
    timeout = timedelta(seconds=manifest["timeout_s"])
    prefixed = dist.PrefixStore(group_prefix(manifest["session"], receiver), connect_store(manifest))
    if manifest["backend"] == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Send ``tensor`` from the trainer (its rank) into the receiver's ``tensor`` of the same shape and dtype."""
    options = dist.BroadcastOptions()
    options.rootRank = TRAINER_RANK
    group.broadcast([tensor], options).wait()


def buffer_views(data: torch.Tensor, entries: list[list]) -> list[torch.Tensor]:
    """Each tensor of ``entries`` (``[name, shape, dtype, offset]``, :func:`~contracts.weight_manifest.layout`) as a
    view into the flat byte buffer ``data``; a ValueError names one that lies outside it or is no dtype."""
    views = []
    for name, shape, dtype_name, offset in entries:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {name}: {dtype_name!r} is not a dtype")
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        if offset % ALIGN or offset + size > len(data):
            raise ValueError(f"tensor {name} ({size} bytes at {offset}) lies outside a {len(data)}-byte buffer")
        views.append(data[offset : offset + size].view(dtype).view(shape))
    return views
