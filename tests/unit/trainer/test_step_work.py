"""A training step does the work of one forward and one backward pass, no more: counted in matmul FLOPs, not timed.

The trainer's step on the CPU debug config (no activation checkpointing, no KL reference, entropy only logged)
multiplies each token once through every linear layer forward and twice backward (input and weight gradients);
the output layer scores only the loss positions, in chunks recomputed in the backward pass (so 4 passes there),
plus the logged entropy's few rows once without gradient. A second forward pass (a logprob pass, a replay, a
recomputation switched on by default) adds a third or more, which wall times on a shared machine cannot show.
"""

import pytest
from batches import random_samples
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig

from contracts.protocol import BatchInfo, MicroBatch
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer
from trainer.scoring import logged_entropy_rows
from trainer.train import build_model, train_step

MATMULS = ("mm", "addmm", "bmm")


def linear_params_per_token(config) -> int:
    """Weights of the decoder layers' linear layers (what each token is multiplied through)."""
    hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                         config.head_dim)  # fmt: skip
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    return config.num_hidden_layers * (attention + 3 * hidden * config.intermediate_size)


def test_a_step_is_one_forward_and_one_backward_pass(tiny_model_path, world):
    config = TrainerConfig(model={"name": tiny_model_path}, output_dir="unused")
    model = build_model(config.model, world, config.optim.offload)
    optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
    samples = random_samples(8)
    micro_batches = [MicroBatch.pack(samples[:4]), MicroBatch.pack(samples[4:])]
    tokens = sum(len(s.token_ids) for s in samples)
    loss_tokens = sum(sum(s.loss_mask) for s in samples)  # the scored positions: no sample starts with one
    info = BatchInfo(1, len(samples), tokens, loss_tokens, 0.0, 1.0)
    with FlopCounterMode(display=False) as counter:
        train_step(model, optimizer, [(m, 1.0) for m in micro_batches], info, config, world)
    counted = {str(op).split(".")[1]: flops for op, flops in counter.get_flop_counts()["Global"].items()}
    matmul_flops = sum(counted.get(name, 0) for name in MATMULS)

    shape = AutoConfig.from_pretrained(tiny_model_path)
    head = 2 * shape.hidden_size * shape.vocab_size  # FLOPs of one position through the output layer
    logged = sum(len(range(int(m.loss_mask.sum()))[logged_entropy_rows(int(m.loss_mask.sum()))]) for m in micro_batches)
    expected = 3 * 2 * tokens * linear_params_per_token(shape) + 4 * loss_tokens * head + logged * head
    assert matmul_flops == pytest.approx(expected, rel=1e-3)
