"""A step on a batch whose every advantage is exactly 0 (what on-policy distillation gives when the teacher is the
student) changes no weight under the default config: the default loss has no term besides the policy term (no
entropy bonus, no KL), no weight decay, and AdamW moves a parameter by ``lr * m / (sqrt(v) + eps) = 0`` when its
gradient has always been 0. (A ``weight_decay`` would shrink every weight by ``lr * weight_decay``: at the default lr of
1e-6 and a decay of 0.01 that factor, 1 - 1e-8, rounds back to 1 in float32, so it too leaves the bits alone.)"""

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from contracts.protocol import BatchInfo, MicroBatch
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer
from trainer.train import build_model, train_step


def full(parameter: torch.Tensor) -> torch.Tensor:
    return (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach().clone()


def stepped_weights(samples, config, world) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's weights before and after one default step on ``samples``."""
    model = build_model(config.model, world, config.optim.offload)
    optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
    before = {name: full(p) for name, p in model.named_parameters()}
    info = BatchInfo(1, len(samples), sum(len(s.token_ids) for s in samples),
                     sum(sum(s.loss_mask) for s in samples), 0.0, 1.0)  # fmt: skip
    train_step(model, optimizer, [(MicroBatch.pack(samples[:3]), 1.0), (MicroBatch.pack(samples[3:]), 1.0)], info,
               config, world)  # fmt: skip
    return before, {name: full(p) for name, p in model.named_parameters()}


def test_a_step_on_all_zero_advantages_changes_no_weight_bit_for_bit(tiny_model_path, world, random_samples):
    config = TrainerConfig(model={"name": tiny_model_path}, output_dir="unused")
    zero = [dataclasses.replace(s, advantage=0.0, token_advantages=[0.0] * len(s.token_ids))
            for s in random_samples(6)]  # fmt: skip
    before, after = stepped_weights(zero, config, world)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed == []
    # the same step with the samples' own advantages moves the weights: the comparison can fail
    before, after = stepped_weights(random_samples(6), config, world)
    assert any(not torch.equal(before[name], after[name]) for name in before)
