"""Supervised fine-tuning on chat transcripts, loss on assistant turns only.

Shares the trainer's model building (FSDP2, dtype, LoRA, activation checkpointing), packed forward pass, optimizer
schedule and weights layout, so ``output_dir/weights/step_N`` can be the ``[model] name`` an RL run starts from.
"""

import functools
import itertools
import logging
import math
import random
import time
from collections.abc import Iterator

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contracts.metrics import MetricsWriter
from contracts.model_card import ModelCard
from contracts.protocol import MicroBatch, Sample, pack_samples
from contracts.run_dir import metrics_path, weights_dir
from trainer.compilation import eager_on_compile_failure
from trainer.config import SFTConfig
from trainer.export import save_weights
from trainer.model import packed_logprobs
from trainer.optim import build_optimizer, clip_gradients
from trainer.parallel import World, close_world, init_world, rank_share, sum_over_ranks
from trainer.sft_data import load_samples, stream_samples
from trainer.train import build_model, warn_on_compile_setting

logger = logging.getLogger("sft")


def nll_loss(
    logprobs: Float[Tensor, " seq"], loss_mask: Bool[Tensor, " seq"], num_loss_tokens: int
) -> Float[Tensor, ""]:
    """A micro-batch's share of the step's mean negative log-likelihood: ``-logprobs[loss_mask].sum() /
    num_loss_tokens``, where ``num_loss_tokens`` counts the whole step's, so the shares sum to the step's mean
    however the step is split into micro-batches."""
    return -(logprobs * loss_mask).sum() / num_loss_tokens


def accumulate_gradients(model: nn.Module, samples: list[Sample], seq_len: int, world: World) -> float:
    """Forward and backward this rank's share of ``samples``, packed into micro-batches of at most ``seq_len``
    tokens; returns the step's mean loss per loss token (over all ranks)."""
    num_loss_tokens = sum(sum(sample.loss_mask) for sample in samples)
    micro_batches = [MicroBatch.pack(group) for group in pack_samples(samples, seq_len)]
    loss_sum = 0.0
    for micro_batch, weight in rank_share(micro_batches, world):
        logprobs = packed_logprobs(model, micro_batch, 1.0, micro_batch.loss_mask)
        loss = nll_loss(logprobs, micro_batch.loss_mask.to(world.device), num_loss_tokens)
        (loss * weight).backward()
        loss_sum += weight * loss.item()
    return sum_over_ranks({"loss": loss_sum}, world.device)["loss"]


def step_batches(
    samples: list[Sample], batch_size: int, num_steps: int, seed: int, shuffle: bool
) -> Iterator[list[Sample]]:
    """``batch_size`` samples for each of ``num_steps`` steps, taken in epochs over ``samples`` (each epoch in a
    new seeded order when ``shuffle``); a batch may span two epochs."""
    rng = random.Random(seed)
    queue: list[Sample] = []
    for _ in range(num_steps):
        while len(queue) < batch_size:
            epoch = list(samples)
            if shuffle:
                rng.shuffle(epoch)
            queue += epoch
        yield queue[:batch_size]
        queue = queue[batch_size:]


def step_batches_of(config: SFTConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[Iterator[list[Sample]], int]:
    """The run's step batches and their number: from samples loaded and checked up front, or read as the steps
    use them when ``data.streaming`` (``max_steps`` steps, which the config requires)."""
    data = config.data
    if data.streaming:
        samples = stream_samples(data, tokenizer, config.seq_len, config.seed if data.shuffle else None)
        return (list(itertools.islice(samples, data.batch_size)) for _ in range(config.max_steps)), config.max_steps
    samples = load_samples(data, tokenizer, config.seq_len)
    num_steps = config.max_steps or math.ceil(data.epochs * len(samples) / data.batch_size)
    return step_batches(samples, data.batch_size, num_steps, config.seed, data.shuffle), num_steps


def train_sft(config: SFTConfig) -> None:
    """Fine-tune ``config.model`` on ``config.data``, on every rank of the process group (or alone); weights go
    to ``output_dir/weights/step_N`` (at the end, and every ``save_every`` steps), metrics to
    ``output_dir/metrics/sft.jsonl``."""
    world = init_world()
    try:
        run_sft(config, world)
    finally:
        close_world()


def run_sft(config: SFTConfig, world: World) -> None:
    warn_on_compile_setting(config.model, world.device)
    torch.manual_seed(config.seed)  # before LoRA's random init: every rank starts from the same adapter
    tokenizer = AutoTokenizer.from_pretrained(ModelCard.of(config.model.name).path)
    batches, num_steps = step_batches_of(config, tokenizer)
    model = build_model(config.model, world, config.optim.offload)
    optimizer, scheduler = build_optimizer(model, config.optim, num_steps)
    metrics = None
    if world.is_main:
        metrics_path(config.output_dir, "sft").unlink(missing_ok=True)  # a previous run's records
        metrics = MetricsWriter(config.output_dir, "sft", config.wandb)
    logger.info(
        f"fine-tuning {config.model.name} on {world.size} × {world.device}: {num_steps} steps "
        f"of {config.data.batch_size} samples"
    )

    for step, batch in enumerate(batches, start=1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        accumulate = functools.partial(accumulate_gradients, model, batch, config.seq_len, world)
        loss = eager_on_compile_failure(accumulate, [model])
        grad_norm = clip_gradients(model, config.optim.max_norm)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        train_s = time.perf_counter() - start
        if step == num_steps or (config.save_every and step % config.save_every == 0):
            # always a full model: what an RL run (or any server) starts from
            save_weights(model, tokenizer, weights_dir(config.output_dir, step), export="merged")

        tokens = sum(len(sample.token_ids) for sample in batch)
        record = {
            "step": step,
            "loss": loss,
            "tokens": tokens,
            "loss_tokens": sum(sum(sample.loss_mask) for sample in batch),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens_per_s": tokens / train_s,
        }
        if metrics:
            metrics.write(record)
        logger.info(
            f"step {step}/{num_steps} | loss {loss:.4f} | tokens {tokens} | grad_norm {record['grad_norm']:.3f} "
            f"| lr {lr:.2e} | {record['tokens_per_s']:.0f} tokens/s"
        )
    if metrics:
        metrics.close()
    logger.info(f"wrote {weights_dir(config.output_dir, num_steps)}")
