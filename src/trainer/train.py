"""The training loop: wait for a batch, compute the loss, step, write weights for inference."""

import logging
import math
import time

import torch
from transformers import AutoTokenizer

from rl.errors import TridentError
from rl.metrics import MetricsWriter
from rl.protocol import read_batch, rollouts_dir, wait_for, weights_dir
from rl.tiny_model import resolve_model_path
from trainer.config import OptimConfig, TrainerConfig
from trainer.loss import policy_loss
from trainer.model import load_model, packed_logprobs, save_weights

logger = logging.getLogger("trainer")


class EmptyBatchError(TridentError):
    """A step whose batch has no sampled token to train on."""


def lr_factor(step: int, max_steps: int, optim: OptimConfig) -> float:
    """The share of ``optim.lr`` used at ``step`` (0-based): linear warm-up, then the schedule's decay."""
    if step < optim.warmup_steps:
        return (step + 1) / (optim.warmup_steps + 1)
    if optim.schedule == "constant":
        return 1.0
    progress = (step - optim.warmup_steps) / max(max_steps - 1 - optim.warmup_steps, 1)
    decay = 1 - progress if optim.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay


def train(config: TrainerConfig) -> None:
    torch.manual_seed(config.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(config.model, device)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model.name))
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.optim.lr,
        betas=config.optim.betas,
        weight_decay=config.optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.max_steps, config.optim)
    )
    metrics = MetricsWriter(config.output_dir, "trainer", config.wandb)
    logger.info(f"training {config.model.name} on {device} for {config.max_steps} steps")

    for step in range(config.max_steps):
        wait_start = time.perf_counter()
        batch_dir = rollouts_dir(config.output_dir, step)
        wait_for(batch_dir.exists, config.batch_timeout_s, f"the orchestrator's batch {batch_dir}")
        info, micro_batches = read_batch(config.output_dir, step)
        if info.num_loss_tokens == 0:
            raise EmptyBatchError(
                f"step {step}: the batch in {batch_dir} has no sampled token to train on "
                f"({info.num_samples} samples, all loss masks empty)"
            )
        train_start = time.perf_counter()

        optimizer.zero_grad(set_to_none=True)
        loss_sum = bounded = mismatch_kl = 0.0
        for micro_batch in micro_batches:
            logprobs = packed_logprobs(model, micro_batch, info.temperature)
            loss, stats = policy_loss(
                logprobs,
                micro_batch.inference_logprobs.to(device),
                micro_batch.advantages.to(device),
                micro_batch.loss_mask.to(device),
                micro_batch.sample_lengths,
                config.loss,
                num_loss_tokens=info.num_loss_tokens,
                num_samples=info.num_samples,
            )
            loss.backward()
            loss_sum += loss.item()
            bounded += stats["bounded_tokens"].item()
            mismatch_kl += stats["mismatch_kl"].item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.max_norm).item()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        save_weights(model, tokenizer, weights_dir(config.output_dir, step + 1))

        record = {
            "step": step,
            "loss": loss_sum,
            "reward_mean": info.reward_mean,
            "tokens": info.num_tokens,
            "loss_tokens": info.num_loss_tokens,
            "bounded_fraction": bounded / info.num_loss_tokens,  # tokens masked or clipped
            "mismatch_kl": mismatch_kl / info.num_loss_tokens,
            "grad_norm": grad_norm,
            "lr": lr,
            "wait_s": train_start - wait_start,
            "train_s": time.perf_counter() - train_start,
        }
        metrics.write(record)
        logger.info(
            f"step {step} | reward {info.reward_mean:.4f} | loss {loss_sum:.4f} | tokens {info.num_tokens} "
            f"| grad_norm {grad_norm:.3f} | mismatch_kl {record['mismatch_kl']:.2e} | {record['train_s']:.2f}s"
        )
    metrics.close()
