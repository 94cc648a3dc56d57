"""The trainer's defaults that differ on a GPU, their code run on the CPU: fused AdamW over FSDP2's sharded
parameters, and the decoder layers kept gathered between forward and backward (``reshard_after_forward`` on one GPU
in full training) give the weights of the CPU's defaults. (Compiled layers: test_compile.py; bf16 compute:
test_train.py; the varlen attention call: test_attention.py.)"""

import pytest
import torch

from contracts.protocol import BatchInfo, MicroBatch
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer
from trainer.train import build_model, train_step


def weights_after_steps(world, micro_batch, steps=3, fused=None, **model) -> tuple[list[float], list[torch.Tensor]]:
    """The losses of ``steps`` train_steps of the tiny model on ``micro_batch``, and its weights after them."""
    config = TrainerConfig(model={"name": model.pop("name"), **model}, optim={"lr": 1e-3, "weight_decay": 0.01})
    torch.manual_seed(0)
    policy = build_model(config.model, world, offload=False)
    optimizer, _ = build_optimizer(policy, config.optim, steps, fused=fused)
    assert bool(optimizer.defaults["fused"]) == bool(fused)
    info = BatchInfo(0, len(micro_batch.sample_lengths), len(micro_batch.input_ids),
                     int(micro_batch.loss_mask.sum()), 0.0, 1.0)  # fmt: skip
    losses = [train_step(policy, optimizer, [(micro_batch, 1.0)], info, config, world)["loss"] for _ in range(steps)]
    return losses, [parameter.full_tensor().detach() for parameter in policy.parameters()]


@pytest.mark.parametrize("gpu_default", [{"fused": True}, {"reshard_after_forward": False}], ids=["fused", "gathered"])
def test_a_gpu_default_trains_as_the_cpu_default(world, random_samples, tiny_model_path, gpu_default):
    micro_batch = MicroBatch.pack(random_samples(3))
    cpu_losses, cpu_weights = weights_after_steps(world, micro_batch, name=tiny_model_path)
    losses, weights = weights_after_steps(world, micro_batch, name=tiny_model_path, **gpu_default)
    assert losses == pytest.approx(cpu_losses, abs=1e-5)
    for weight, cpu_weight in zip(weights, cpu_weights, strict=True):
        torch.testing.assert_close(weight, cpu_weight, atol=1e-5, rtol=1e-5)
    assert cpu_losses[0] != cpu_losses[-1]  # the steps trained
