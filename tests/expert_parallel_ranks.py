"""What tests/integration/test_expert_parallel_two_ranks.py runs on two gloo ranks (``torchrun ...
expert_parallel_ranks.py FOLDER``), in one launch: a step of the tiny MoE with its experts split over both ranks
(ep = 2) beside the same step with every rank holding all experts (ep = 1), in full training and under LoRA on
attention; then an ep = 2 run of 3 steps, and the same run stopped after its checkpoint of step 2 and resumed. FOLDER
holds the batches (``whole/`` and ``resumed/``, written by the test); rank 0 writes ``steps.json``, the trainer's runs
their usual files."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from trainer_runs import write_orchestrator_part

from contracts.protocol import read_batch
from tools.tiny_model import built_model_path
from trainer.config import TrainerConfig
from trainer.export import full_weights
from trainer.optim import build_optimizer, clip_gradients
from trainer.parallel import World, close_world, init_world, rank_share, sum_over_ranks
from trainer.train import build_model, forward_backward, run_training

LORA = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}


def one_step(config: TrainerConfig, world: World) -> tuple[float, dict, dict]:
    """Step 1 of ``config``'s run: its loss, each parameter's gradient in full, and the weights for inference after
    the optimizer step (rank 0's, as the files and the broadcast get them)."""
    torch.manual_seed(config.seed)  # every build starts from the same adapter
    model = build_model(config.model, world, offload=False)
    optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
    info, micro_batches = read_batch(config.output_dir, 1, model.config.vocab_size)
    sums = forward_backward(model, rank_share(micro_batches, world), info, config, world, None)
    loss = sum_over_ranks({"loss": sums["loss"].item()}, world.device)["loss"]
    gradients = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    clip_gradients(model, config.optim.max_norm)
    optimizer.step()
    return loss, gradients, full_weights(model, torch.float32)[1]


def compare_steps(config: TrainerConfig, world: World) -> dict:
    """Step 1 with ep = 1 and ep = 2: both losses, and per tensor the largest gradient and the largest difference
    between the two runs' gradients and weights after the step."""
    runs = []
    for ep in (1, 2):
        model = config.model.model_copy(update={"parallel": config.model.parallel.model_copy(update={"ep": ep})})
        runs.append(one_step(config.model_copy(update={"model": model}), world))
    (loss_1, gradients_1, weights_1), (loss_2, gradients_2, weights_2) = runs
    return {
        "loss": [loss_1, loss_2],
        "gradient": {name: gradients_1[name].abs().max().item() for name in gradients_1},
        "gradient_difference": {
            name: (gradients_1[name] - gradients_2[name]).abs().max().item() for name in gradients_1 | gradients_2
        },  # fmt: skip
        "weight_shapes": {name: list(tensor.shape) for name, tensor in weights_2.items()},
        "weight_difference": {
            name: (weights_1[name] - weights_2[name]).abs().max().item() for name in weights_1 | weights_2
        },  # fmt: skip
    }


def main(folder: Path) -> None:
    world = init_world()
    try:
        base = {"output_dir": folder / "whole", "max_steps": 3, "optim": {"lr": 1e-3}, "batch_timeout_s": 5}
        model = {"name": built_model_path("trident/tiny-qwen3-moe"), "parallel": {"ep": 2}}
        steps = {
            "full": compare_steps(TrainerConfig(model=model, **base), world),
            "lora": compare_steps(TrainerConfig(model={**model, "experimental": {"lora": LORA}}, **base), world),
        }
        if world.is_main:
            (folder / "steps.json").write_text(json.dumps(steps))

        run_training(TrainerConfig(model=model, ckpt={"interval": 2}, **base), world)
        resumed = {**base, "output_dir": folder / "resumed"}
        run_training(TrainerConfig(model=model, ckpt={"interval": 2}, **{**resumed, "max_steps": 2}), world)
        if world.is_main:
            write_orchestrator_part(folder / "resumed", 2)  # the orchestrator's part of step 2
        dist.barrier()
        run_training(TrainerConfig(model=model, ckpt={"interval": 2, "resume_step": 2}, **resumed), world)
    finally:
        close_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
