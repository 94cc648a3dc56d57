"""What tests/integration/test_context_parallel_two_ranks.py runs on two gloo ranks (``torchrun ...
context_parallel_ranks.py FOLDER``), in one launch: a step of tiny-qwen3 with each micro-batch's tokens split over both
ranks (cp = 2) beside the same step with each rank holding whole micro-batches (cp = 1), in full training, under
LoRA with activation checkpointing (and the sequence-level ratio, normalisation and correction, the entropy bonus,
the KL penalty and a top-p truncation), and in full training with the GPU's varlen attention (its kernel's
documented stand-in); then a cp = 2 run of 3 steps, and the same run stopped after its checkpoint of step 2 and
resumed.

The batch (:func:`write_long_batches`): 4 micro-batches of up to 256 tokens, packed from samples of 20-60 tokens and
three long ones (200 tokens of which 150 prompt, 170 and 130 tokens): samples longer than a 128-token shard, others
shorter, samples across the shards' boundary, rows of odd length (padded), and a shard with no token to score.
FOLDER gets the batches (``whole/`` and ``resumed/``); rank 0 writes ``steps.json``, the trainer's runs their usual
files."""

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from batches import random_samples
from trainer_runs import write_orchestrator_part
from varlen_stand_in import documented_varlen, varlen_packing

from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_samples, read_batch, write_batch
from contracts.sampling import NO_TRUNCATION, Truncation
from tools.tiny_model import built_model_path
from trainer import attention
from trainer import model as trainer_model
from trainer.config import ParallelConfig, TrainerConfig
from trainer.export import full_weights
from trainer.optim import build_optimizer, clip_gradients
from trainer.parallel import World, close_world, init_world, rank_share, sum_over_ranks
from trainer.train import build_model, forward_backward, frozen_reference, run_training

SEQ_LEN = 256
LORA = {"rank": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}
LORA_LOSS = {
    "ratio": "sequence",
    "normalization": "sequence",
    "mask_low": 1e-3,
    "mask_high": 1e3,
    "correction": "geometric_truncate",
    "correction_low": 0.99,
    "correction_high": 1.01,
    "entropy_coef": 0.01,
    "kl_coef": 0.05,
}


def long_sample(length: int, prompt: int, seed: int) -> Sample:
    """A sample of ``length`` random tokens whose first ``prompt`` are the prompt."""
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 2000, (length,), generator=generator).tolist()
    logprobs = (-7.6 + 0.05 * torch.randn(length - prompt, generator=generator)).tolist()
    return Sample(token_ids, [False] * prompt + [True] * (length - prompt), [0.0] * prompt + logprobs, 0.7, 0.0, 0)


def write_long_batches(output_dir: Path, steps: int, truncation: Truncation = NO_TRUNCATION) -> int:
    """The module's batch (see its docstring) for steps 1..steps under ``output_dir``; the number of micro-batches."""
    samples = [long_sample(200, 150, 1), long_sample(170, 40, 2), long_sample(130, 60, 3), *random_samples(9)]
    micro_batches = [MicroBatch.pack(bin) for bin in pack_samples(samples, SEQ_LEN)]
    num_tokens = sum(len(s.token_ids) for s in samples)
    num_loss_tokens = sum(sum(s.loss_mask) for s in samples)
    for step in range(1, steps + 1):
        info = BatchInfo(step, len(samples), num_tokens, num_loss_tokens, 0.0, 0.8, truncation)
        write_batch(output_dir, info, micro_batches)
    return len(micro_batches)


@contextmanager
def varlen_on_the_cpu() -> Iterator[None]:
    """Packed attention as on a GPU (one varlen call per layer), with the documented stand-in for the kernel."""
    saved = attention.varlen_attn, attention.VARLEN_DTYPES, trainer_model.packing
    attention.varlen_attn, attention.VARLEN_DTYPES = documented_varlen, (torch.float32,)
    trainer_model.packing = varlen_packing
    try:
        yield
    finally:
        attention.varlen_attn, attention.VARLEN_DTYPES, trainer_model.packing = saved


def one_step(config: TrainerConfig, world: World) -> tuple[dict, dict, dict, dict]:
    """Step 1 of ``config``'s run: its loss and statistics (summed over the ranks), each parameter's gradient in
    full, and the weights for inference before and after the optimizer step."""
    torch.manual_seed(config.seed)  # every build starts from the same adapter
    model = build_model(config.model, world, offload=False)
    optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
    info, micro_batches = read_batch(config.output_dir, 1, model.config.vocab_size)
    reference = frozen_reference(model, config, world)
    sums = forward_backward(model, rank_share(micro_batches, world), info, config, world, reference)
    totals = sum_over_ranks({name: value.item() for name, value in sums.items()}, world.device)
    gradients = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    clip_gradients(model, config.optim.max_norm)
    before = full_weights(model, torch.float32)[1]
    optimizer.step()
    return totals, gradients, before, full_weights(model, torch.float32)[1]


def compare_steps(config: TrainerConfig, worlds: dict[int, World]) -> dict:
    """Step 1 with cp = 1 and cp = 2: the statistics of each, and per tensor the largest gradient and the largest
    change of the weights in the cp = 1 step, and the largest difference between the two runs' gradients and weights
    after the step."""
    (totals_1, gradients_1, before, weights_1), (totals_2, gradients_2, _, weights_2) = (
        one_step(
            config.model_copy(update={"model": config.model.model_copy(update={"parallel": ParallelConfig(cp=cp)})}),
            world,
        )
        for cp, world in worlds.items()
    )
    return {
        "totals": [totals_1, totals_2],
        "gradient": {name: gradients_1[name].abs().max().item() for name in gradients_1},
        "gradient_difference": {
            name: (gradients_1[name] - gradients_2[name]).abs().max().item() for name in gradients_1 | gradients_2
        },  # fmt: skip
        "update": {name: (weights_1[name] - before[name]).abs().max().item() for name in weights_1},
        "weight_difference": {
            name: (weights_1[name] - weights_2[name]).abs().max().item() for name in weights_1 | weights_2
        },  # fmt: skip
    }


def main(folder: Path) -> None:
    world = init_world(2)  # cp = 2: both ranks split each micro-batch
    whole = World(world.rank, world.size, world.device)  # cp = 1: each rank its own micro-batches
    worlds = {1: whole, 2: world}
    try:
        base = {"max_steps": 3, "optim": {"lr": 1e-3}, "batch_timeout_s": 5, "seq_len": SEQ_LEN}
        model = {"name": built_model_path("trident/tiny-qwen3")}
        steps = {
            "full": compare_steps(TrainerConfig(model=model, output_dir=folder / "full", **base), worlds),
            "lora": compare_steps(
                TrainerConfig(
                    model={**model, "experimental": {"lora": LORA}, "ac": {}},  # every layer recomputed
                    loss=LORA_LOSS,
                    output_dir=folder / "lora",
                    **base,
                ),
                worlds,
            ),
        }
        with varlen_on_the_cpu():  # the GPU's attention, one varlen call per layer over the whole row
            steps["varlen"] = compare_steps(TrainerConfig(model=model, output_dir=folder / "full", **base), worlds)
        if world.is_main:
            (folder / "steps.json").write_text(json.dumps(steps))

        model = {**model, "parallel": {"cp": 2}}
        run = {**base, "model": model, "ckpt": {"interval": 2}}
        run_training(TrainerConfig(output_dir=folder / "whole", **run), world)
        resumed = {**run, "output_dir": folder / "resumed"}
        run_training(TrainerConfig(**{**resumed, "max_steps": 2}), world)
        if world.is_main:
            write_orchestrator_part(folder / "resumed", 2)  # the orchestrator's part of step 2
        dist.barrier()
        run_training(TrainerConfig(**{**resumed, "ckpt": {"interval": 2, "resume_step": 2}}), world)
    finally:
        close_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
