"""The trainer on one or several devices: the process group, FSDP2 sharding, and this rank's share of a batch.

Under ``torchrun`` every rank joins the launcher's process group (NCCL on GPU, gloo on CPU); run alone, the
trainer makes a one-rank group in-process. Either way the model is sharded with FSDP2 (``fully_shard``), so
one code path gives mixed precision, CPU offload and several devices.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from contracts.metrics import setup_logging
from contracts.protocol import MicroBatch
from trainer.context_parallel import context_group
from trainer.moe.expert_parallel import expert_mesh, split_experts


@dataclass(frozen=True)
class World:
    """The trainer's ranks: ``size`` in all, as ``size / cp`` data-parallel groups of ``cp`` consecutive ranks that
    split each micro-batch's tokens between them (context parallelism, ``cp_group``; None when ``cp`` is 1)."""

    rank: int
    size: int
    device: torch.device
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which data-parallel group this rank is in: the group takes every ``dp_size``-th micro-batch."""
        return self.rank // self.cp

    @property
    def dp_size(self) -> int:
        return self.size // self.cp

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group: the ``cp_rank``-th shard of each micro-batch's tokens."""
        return self.rank % self.cp


def init_world(cp: int = 1) -> World:
    """Join torchrun's process group, or create a one-rank group when the trainer runs alone; with ``cp`` > 1, this
    rank's group of ``cp`` consecutive ranks (context parallelism) too."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:  # set by torchrun
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = context_group(cp, device.type) if cp > 1 else None
    return World(dist.get_rank(), dist.get_world_size(), device, cp, group)


def setup_rank_logging(process: str, level: str) -> None:
    """Log as ``process`` at ``level`` on rank 0; other torchrun ranks log warnings and errors only."""
    rank = int(os.environ.get("RANK", 0))
    setup_logging(process if rank == 0 else f"{process}[{rank}]", level if rank == 0 else "WARNING")


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_model(
    model: nn.Module,
    layers: nn.ModuleList,
    compute_dtype: torch.dtype,
    offload: bool,
    reshard_after_forward: bool = True,
    ep: int = 1,
) -> None:
    """Shard each decoder layer, then the rest, across the ranks (FSDP2), in place; with ``ep`` > 1 each
    mixture-of-experts layer's experts are first split over groups of ``ep`` ranks (:mod:`trainer.moe.expert_parallel`)
    and sharded over the groups.

    Parameters stay float32 (the master weights); forward and backward run in ``compute_dtype`` and gradients
    are reduced in float32. With ``offload``, parameters, gradients and optimizer state live in CPU memory.
    Gradients are summed over ranks, not averaged: the loss is already normalized by the whole step's counts.
    Without ``reshard_after_forward`` each layer's gathered parameters stay until its backward pass.
    """
    kwargs = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    if ep > 1:
        mesh = expert_mesh(ep, "cuda" if torch.cuda.is_available() else "cpu")
        for experts in split_experts(model, mesh):
            fully_shard(experts, mesh=mesh["replica"], reshard_after_forward=reshard_after_forward, **kwargs)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # the root is not resharded: its backward comes first
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-scaled sum


def rank_share(micro_batches: list[MicroBatch], world: World) -> list[tuple[MicroBatch, float]]:
    """This rank's micro-batches (round-robin over the data-parallel groups: every rank of a context-parallel group
    gets its group's), each with the weight of its loss.

    Every rank must run as many forward/backward passes as the others (FSDP's collectives pair them up), so a
    rank with fewer micro-batches repeats one with weight 0: it takes part in the collectives but adds nothing.
    """
    count = -(-len(micro_batches) // world.dp_size)
    mine = micro_batches[world.dp_rank :: world.dp_size]
    return [(micro_batch, 1.0) for micro_batch in mine] + [(micro_batches[0], 0.0)] * (count - len(mine))


def sum_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value summed over all ranks."""
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return dict(zip(values, tensor.tolist(), strict=True))
