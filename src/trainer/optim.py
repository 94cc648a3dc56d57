"""The optimizer and learning-rate schedule, and gradient clipping, shared by RL and SFT training."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import OptimConfig


def lr_factor(step: int, max_steps: int, optim: OptimConfig) -> float:
    """The share of ``optim.lr`` used at ``step`` (0-based): linear warm-up, then the schedule's decay."""
    if step < optim.warmup_steps:
        return (step + 1) / (optim.warmup_steps + 1)
    if optim.schedule == "constant":
        return 1.0
    progress = (step - optim.warmup_steps) / max(max_steps - 1 - optim.warmup_steps, 1)
    decay = 1 - progress if optim.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay


def build_optimizer(
    model: nn.Module, optim: OptimConfig, num_steps: int, fused: bool | None = None
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable parameters, with ``optim``'s lr schedule over ``num_steps`` steps; ``fused``
    (one kernel per step for all parameters) where they are all on a GPU, unless given."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if fused is None:
        fused = all(p.device.type == "cuda" for p in trainable)
    optimizer = torch.optim.AdamW(
        trainable, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=fused or None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, num_steps, optim))
    return optimizer, scheduler


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to a global L2 norm of ``max_norm`` (over all ranks); returns the norm before, on the
    device (reading it waits for the backward pass: read it after the optimizer step).

    Parameters sharded over different device meshes (expert parallelism's experts beside FSDP's other parameters)
    are normed per mesh, and the meshes' norms combined."""
    groups: dict[object, list[torch.Tensor]] = {}
    for parameter in model.parameters():
        if parameter.grad is not None:
            mesh = parameter.device_mesh if isinstance(parameter, DTensor) else None
            groups.setdefault(mesh, []).append(parameter)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
