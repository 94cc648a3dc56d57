"""The training loop: wait for a batch, compute the loss, step, write weights for inference."""

import atexit
import logging
import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoTokenizer

from contracts.checkpoint import checkpoint_due
from contracts.errors import TridentError
from contracts.metrics import MetricsWriter
from contracts.model_card import ModelCard
from contracts.progress import Progress, last_written
from contracts.protocol import BatchInfo, MicroBatch, prune_rollouts, read_batch, repack
from contracts.run_dir import resume_step, rollouts_dir, wait_for, weights_dir
from trainer.ckpt import Checkpointer, prune_checkpoints
from trainer.compilation import compile_layers, compiles, eager_on_compile_failure, per_packing_warning
from trainer.config import TrainerConfig, TrainerModelConfig
from trainer.export import save_weights
from trainer.idle_cores import IdleCores
from trainer.loss import cross_entropy_term, mismatch_kl, policy_loss
from trainer.model import Scores, decoder_layers, load_model, packed_logprobs, packed_scores
from trainer.moe.routing import Routers, check_routes
from trainer.optim import build_optimizer, clip_gradients
from trainer.parallel import (
    World,
    close_world,
    init_world,
    rank_share,
    shard_model,
    sum_over_ranks,
)
from trainer.peft_model import is_peft
from trainer.plan import reshards_after_forward
from trainer.rules import check_trainer_model
from trainer.shared_prefix import computed_tokens, pack_groups
from trainer.transports import memory_sender
from trainer.transports.base import WeightSender
from trainer.transports.delta_files import DeltaFileSender

logger = logging.getLogger("trainer")


class EmptyBatchError(TridentError):
    """A step whose batch has no sampled token to train on."""


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype: ``auto`` is bfloat16 on GPU and float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def build_model(model_config: TrainerModelConfig, world: World, offload: bool) -> nn.Module:
    """The policy (fp32 master weights, LoRA, activation checkpointing and compilation as configured), sharded over
    the ranks.

    A full-precision model loads on the CPU and FSDP2 moves each rank's shard to its device; a 4-bit base
    (QLoRA) is quantized on the device it runs on, by one rank.
    """
    dtype = compute_dtype(model_config.dtype, world.device)
    in_4bit = model_config.experimental.load_in_4bit
    if in_4bit and world.size > 1:
        raise TridentError(
            f"model.experimental.load_in_4bit trains on one rank; this trainer has {world.size} (give it one GPU)"
        )
    model = load_model(model_config, world.device if in_4bit else torch.device("cpu"), dtype)
    offload = offload and world.device.type == "cuda"
    reshard = reshards_after_forward(model_config, world.size, world.device.type == "cuda", offload)
    shard_model(model, decoder_layers(model), dtype, offload, reshard, model_config.parallel.ep)
    if compiles(model_config.compile, world.device, dtype, model_config.parallel.ep, world.cp):
        compile_layers(model)
    return model


def check_start(config: TrainerConfig, world: World) -> ModelCard:
    """Refuse what the trainer cannot run on this model and these ranks, before loading it: the refusals ``rl``
    makes before it starts anything (:func:`trainer.rules.check_trainer_model`), on the model's card (the hub's
    config where the model is not on this machine yet). Returns the card."""
    card = ModelCard.of(config.model.name).hub()
    check_trainer_model(card, config.model, world.size, f"{world.size} ranks", prefix="")
    return card


def warn_on_compile_setting(model_config: TrainerModelConfig, device: torch.device) -> None:
    """One warning line where ``model.compile`` is on and compiles each packing anew (see ``per_packing_warning``)."""
    warning = per_packing_warning(model_config.compile, device, compute_dtype(model_config.dtype, device))
    if warning:
        logger.warning(warning)


@dataclass(frozen=True)
class FrozenReference:
    """The model the KL penalty pulls towards: the policy with its adapter switched off under LoRA (``model`` is the
    policy), else a frozen copy of the initial model; images are read from the run in ``output_dir``."""

    model: nn.Module
    output_dir: Path
    group: dist.ProcessGroup | None = None  # the context-parallel group, as the policy's

    def logprobs(self, micro_batch: MicroBatch, info: BatchInfo, share: bool = False) -> Tensor:
        """Its logprobs of the trained tokens, sampled as ``info`` says (temperature and truncation); with
        ``share``, shared beginnings computed once (:mod:`trainer.shared_prefix`)."""
        with torch.no_grad():
            with self.model.disable_adapter() if is_peft(self.model) else nullcontext():
                return packed_logprobs(
                    self.model,
                    micro_batch,
                    info.temperature,
                    micro_batch.loss_mask,
                    info.truncation,
                    self.output_dir,
                    self.group,
                    share,
                )


def frozen_reference(model: nn.Module, config: TrainerConfig, world: World) -> FrozenReference | None:
    """The KL penalty's reference (None when ``kl_coef`` is 0)."""
    if config.loss.kl_coef == 0:
        return None
    if is_peft(model):
        return FrozenReference(model, config.output_dir, world.cp_group)
    reference = build_model(config.model, world, config.optim.offload).requires_grad_(False).eval()
    return FrozenReference(reference, config.output_dir, world.cp_group)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[MicroBatch, float]],
    info: BatchInfo,
    config: TrainerConfig,
    world: World,
    reference: FrozenReference | None = None,
    routers: Routers | None = None,
) -> dict[str, float]:
    """One optimizer step over this rank's (micro-batch, loss weight) pairs; returns the step's metrics, summed
    over all ranks and averaged over the step's loss tokens where they are per-token (with ``routers``, a
    mixture-of-experts model's, also its router metrics). Where compiling the layers fails, the forward and
    backward passes run again eagerly (``eager_on_compile_failure``).

    The micro-batches' metrics add up on the device; the host reads them once, after the optimizer step, so it
    never waits for the device within the step.
    """
    optimizer.zero_grad(set_to_none=True)
    models = [model] if reference is None else [model, reference.model]
    sums = eager_on_compile_failure(
        lambda: forward_backward(model, micro_batches, info, config, world, reference, routers), models
    )
    grad_norm = clip_gradients(model, config.optim.max_norm)
    optimizer.step()
    totals = sum_over_ranks(dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=True)), world.device)
    entropy_tokens = totals.pop("entropy_tokens")
    corrected_samples = totals.pop("corrected_samples", None)  # with an off-policy correction
    aux_loss = totals.pop("router/aux_loss", None)  # with the load-balancing loss
    replayed_tokens = totals.pop("replayed_tokens", None)  # with routing replay
    ce_loss = totals.pop("ce_loss", None)  # with cross-entropy tokens
    metrics = {
        "loss": totals.pop("loss"),
        "grad_norm": grad_norm.item(),
        "entropy": totals.pop("entropy") / max(entropy_tokens, 1),
    }
    metrics |= {name: value / max(info.num_loss_tokens, 1) for name, value in totals.items()}
    if ce_loss is not None:  # the cross-entropy component of the loss: its mean -w * logprob over its tokens
        metrics["ce_loss"] = ce_loss
    if "bounded_tokens" in metrics:  # share of tokens masked or clipped (none such with sapo or a custom term)
        metrics["bounded_fraction"] = metrics.pop("bounded_tokens")
    if "outside_kept_tokens" in metrics:  # with a truncation: share of tokens outside the trainer's kept set
        metrics["outside_kept_fraction"] = metrics.pop("outside_kept_tokens")
    metrics["token_staleness_mean"] = metrics.pop("token_staleness")  # steps, over the loss tokens
    metrics["stale_token_share"] = metrics.pop("stale_tokens")
    if config.loss.max_token_staleness is not None:  # share of loss tokens dropped as too stale
        metrics["too_stale_fraction"] = metrics.pop("too_stale_tokens")
    if corrected_samples is not None:  # shares of tokens and of samples whose weight was truncated or masked
        metrics["corrected_fraction"] = metrics.pop("corrected_tokens")
        metrics["corrected_sample_fraction"] = corrected_samples / info.num_samples
    if replayed_tokens is not None:
        metrics["replayed_fraction"] = replayed_tokens / info.num_tokens
    if routers is not None:
        metrics |= routers.step_metrics()
    if aux_loss is not None:
        metrics["router/aux_loss"] = aux_loss
    return metrics


def micro_batch_loss(
    scores: Scores,
    micro_batch: MicroBatch,
    info: BatchInfo,
    config: TrainerConfig,
    device: torch.device,
    reference_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one micro-batch, its share of the step's, from the model's ``scores`` of its tokens: the policy
    loss (:func:`~trainer.loss.policy_loss`) on its sampled tokens, normalized over the step's sampled tokens, plus,
    where it has cross-entropy weights, the cross-entropy term (:func:`~trainer.loss.cross_entropy_term`)
    normalized over the step's weighted tokens: mixing environments changes neither component's scale."""
    loss_mask = micro_batch.loss_mask.to(device, non_blocking=True)
    loss, stats = policy_loss(
        scores.logprobs,
        micro_batch.inference_logprobs.to(device, non_blocking=True),
        micro_batch.advantages.to(device, non_blocking=True),
        loss_mask,
        micro_batch.sample_lengths,
        config.loss,
        num_loss_tokens=max(info.num_loss_tokens, 1),  # 0: a step of cross-entropy tokens only
        num_samples=info.num_samples,
        entropy=scores.entropy,
        reference_logprobs=reference_logprobs,
        entropy_mask=scores.entropy_mask & loss_mask,
        staleness=(info.step - 1 - micro_batch.weight_steps).to(device, non_blocking=True),
    )
    if info.truncation.on:  # sampled tokens the trainer's own truncation would have dropped
        stats["outside_kept_tokens"] = (scores.outside_kept * loss_mask).sum()
    if micro_batch.ce_weights is not None:
        ce = cross_entropy_term(scores.logprobs, micro_batch.ce_weights.to(device, non_blocking=True),
                                info.num_ce_tokens)  # fmt: skip
        stats["ce_loss"] = ce.detach()
        loss = loss + ce
    return loss, stats


def shares_prefixes(config: TrainerConfig, world: World, routers: Routers | None) -> bool:
    """Whether the step computes its samples' shared beginnings once (``share_prefixes``): on the CPU, without
    context parallelism or a mixture of experts (whose router metrics and balancing loss count every token)."""
    return config.share_prefixes and world.device.type == "cpu" and world.cp_group is None and routers is None


def forward_backward(
    model: nn.Module,
    micro_batches: list[tuple[MicroBatch, float]],
    info: BatchInfo,
    config: TrainerConfig,
    world: World,
    reference: FrozenReference | None,
    routers: Routers | None = None,
) -> dict[str, Tensor]:
    """The forward and backward passes of a step's micro-batches, gradients added up in the model; returns the
    sums of the loss and its statistics, weighted, on the device (on the first rank of each context-parallel group;
    0 on the others, whose loss is the same).

    A mixture-of-experts model's ``routers`` record each micro-batch's routing (not a filler's of weight 0) and,
    under ``model.moe.replay``, force the micro-batch's routes. Its load-balancing loss (``model.moe.aux_loss_coef``)
    counts each micro-batch by its share of the step's tokens, so the step's is their token-weighted mean
    whatever the split over micro-batches and ranks.
    """
    entropy_mode = "trained" if config.loss.entropy_coef > 0 else "logged"  # logged: a strided subset, no gradient
    moe = config.model.moe
    share = shares_prefixes(config, world, routers)
    sums: dict[str, Tensor] = {}
    if routers is not None:
        routers.start_step()
    # one rank on the CPU: reducing each micro-batch's gradients is only a copy of them; reduce the step's sum once
    sync_once = world.size == 1 and world.device.type == "cpu" and isinstance(model, FSDPModule)
    for index, (micro_batch, weight) in enumerate(micro_batches):
        if sync_once:
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        routes = micro_batch.routes if moe.replay else None
        loss_mask = micro_batch.loss_mask.to(world.device, non_blocking=True)
        ce_weights = micro_batch.ce_weights
        scored = micro_batch.loss_mask if ce_weights is None else micro_batch.loss_mask | (ce_weights != 0)
        inference_logprobs = micro_batch.inference_logprobs.to(world.device, non_blocking=True)
        with routers.micro_batch(routes, measure=weight > 0) if routers else nullcontext():
            scores = packed_scores(
                model,
                micro_batch,
                info.temperature,
                scored,
                entropy_mode,
                info.truncation,
                config.output_dir,
                world.cp_group,
                share,
            )
            reference_logprobs = reference.logprobs(micro_batch, info, share) if reference else None
            loss, stats = micro_batch_loss(scores, micro_batch, info, config, world.device, reference_logprobs)
            total = loss
            if routers is not None and routers.balancing:
                balance = routers.balance() * (len(micro_batch.input_ids) / info.num_tokens)
                total = loss + moe.aux_loss_coef * balance
                stats["router/aux_loss"] = balance.detach()
            (total * weight).backward()
            if routers is not None:
                routers.add_micro_batch()
        if moe.replay:  # the same tokens scored with the trainer's own routing, for comparison (on every rank and
            # micro-batch alike, routes or not: FSDP pairs each rank's passes with the others')
            stats["replayed_tokens"] = torch.tensor(0 if routes is None else len(routes), device=world.device)
            with routers.micro_batch(None, measure=False), torch.no_grad():
                own = packed_logprobs(
                    model,
                    micro_batch,
                    info.temperature,
                    micro_batch.loss_mask,
                    info.truncation,
                    config.output_dir,
                    world.cp_group,
                )
            stats["mismatch_kl_no_replay"] = mismatch_kl(own, inference_logprobs, loss_mask)
        counted = weight if world.cp_rank == 0 else 0.0  # a context-parallel group's ranks hold the same sums
        for name, value in {"loss": loss.detach(), **stats}.items():
            sums[name] = sums.get(name, 0) + counted * value.double()
    return sums


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far: allocated GPU memory on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train(config: TrainerConfig) -> None:
    """Train for ``config.max_steps`` steps, on every rank of the process group (or alone)."""
    world = init_world(config.model.parallel.cp)
    try:
        run_training(config, world)
    finally:
        close_world()


def weight_sender(config: TrainerConfig, world: World) -> WeightSender | None:
    """Rank 0's end of the in-memory weight broadcast, when ``[weight_broadcast]`` is on (closed when the trainer
    exits: a shared buffer's ``/dev/shm`` file goes; deltas over a process group under ``[weights] delta``), or of
    delta files under ``[weights] delta``; None: full files."""
    broadcast = config.weight_broadcast
    if not world.is_main:
        return None
    delta, full_every = config.weights.delta, config.weights.full_every
    if broadcast is None:
        return None if delta == "off" else DeltaFileSender(delta, full_every)
    sender = memory_sender(broadcast.host, broadcast.port, broadcast.timeout_s, broadcast.backend, world.device,
                           broadcast.receivers, delta, full_every)  # fmt: skip
    atexit.register(sender.close)
    return sender


def micro_batches_to_train(
    micro_batches: list[MicroBatch], config: TrainerConfig, step: int, share: bool = False
) -> list[MicroBatch]:
    """A step's micro-batches as the trainer trains them: packed anew into ``micro_batch_tokens`` when set, else as
    the orchestrator packed them, which must hold at most ``seq_len`` tokens each (the memory planned for); with
    ``share``, packed anew so that samples beginning alike share micro-batches (:func:`pack_groups`), each computing
    at most that many tokens."""
    if config.micro_batch_tokens is None:
        longest = max((len(micro_batch.input_ids) for micro_batch in micro_batches), default=0)
        if longest > config.seq_len:
            raise TridentError(
                f"step {step}: the orchestrator packed a micro-batch of {longest} tokens, more than the trainer's "
                f"seq_len = {config.seq_len}; give both the same seq_len (rl and its run spec do)"
            )
    if share and (grouped := pack_groups(micro_batches, config.micro_batch_budget)) is not None:
        return grouped
    if config.micro_batch_tokens is not None:
        return repack(micro_batches, config.micro_batch_tokens)
    return micro_batches


def run_training(config: TrainerConfig, world: World) -> None:
    card = check_start(config, world)
    warn_on_compile_setting(config.model, world.device)
    torch.manual_seed(config.seed)  # before LoRA's random init: every rank starts from the same adapter
    model = build_model(config.model, world, config.optim.offload)
    reference = frozen_reference(model, config, world)
    routers = Routers.install(decoder_layers(model), config.model.moe, world.device)
    if routers is not None and reference is not None and reference.model is not model:
        routers.attach(decoder_layers(reference.model))  # the reference replays the same routes
    tokenizer = AutoTokenizer.from_pretrained(card.path)
    share = shares_prefixes(config, world, routers)
    idle = None
    if config.borrow_idle_cores and config.model.compile is not True:
        idle = IdleCores.install(model, decoder_layers(model), config.output_dir, config.async_level, config.max_steps)
    optimizer, scheduler = build_optimizer(model, config.optim, config.max_steps)
    metrics = MetricsWriter(config.output_dir, "trainer", config.wandb) if world.is_main else None
    progress = Progress(config.output_dir if world.is_main else None, "trainer")
    export = config.model.experimental.lora.export if config.model.experimental.lora else "merged"  # full weights
    dtype = compute_dtype(config.model.dtype, world.device)  # of the weights the server loads
    sender = weight_sender(config, world)
    checkpointer = Checkpointer(config.output_dir, world, model, optimizer, scheduler)
    start = 0
    if config.ckpt and config.ckpt.resume_step is not None:
        start = resume_step(config.output_dir, config.ckpt.resume_step)
        checkpointer.load(start)
        # the run's weights were cleared: the server needs these before it samples step `start + 1`
        save_weights(model, tokenizer, weights_dir(config.output_dir, start), export, sender, dtype)
    logger.info(f"training {config.model.name} on {world.size} × {world.device}, steps {start + 1}..{config.max_steps}")

    for step in range(start + 1, config.max_steps + 1):  # step N: the N-th optimizer update, its result weights N
        wait_start = time.perf_counter()
        batch_dir = rollouts_dir(config.output_dir, step)
        with progress.doing(f"waiting for the batch of step {step}"):
            wait_for(batch_dir.exists, config.batch_timeout_s, f"the orchestrator's batch {batch_dir}",
                     sign_of_life=lambda: last_written(config.output_dir, "orchestrator"))  # fmt: skip
        info, micro_batches = read_batch(config.output_dir, step, model.config.get_text_config().vocab_size)
        micro_batches = micro_batches_to_train(micro_batches, config, step, share)
        if routers is not None and config.model.moe.replay:
            for micro_batch in micro_batches:
                if micro_batch.routes is not None:
                    check_routes(
                        micro_batch.routes, routers.num_layers, routers.top_k, routers.num_experts, str(batch_dir)
                    )
        if world.is_main:
            prune_rollouts(config.output_dir, step, config.keep_rollouts)
        if info.num_loss_tokens == 0 and info.num_ce_tokens == 0:
            raise EmptyBatchError(
                f"step {step}: the batch in {batch_dir} has no sampled token to train on "
                f"({info.num_samples} samples, all loss masks empty, no cross-entropy weight)"
            )
        train_start = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        with progress.doing(f"training step {step}"), idle.step(step) if idle else nullcontext():
            record = train_step(
                model, optimizer, rank_share(micro_batches, world), info, config, world, reference, routers
            )
        scheduler.step()
        save_start = time.perf_counter()
        last = step == config.max_steps  # no one samples from the last weights: files, the run's model
        with progress.doing(f"writing weights step {step}"):
            save_weights(
                model, tokenizer, weights_dir(config.output_dir, step), export, None if last else sender, dtype
            )
        train_s = save_start - train_start
        record = {
            "step": step,
            "reward_mean": info.reward_mean,
            "tokens": info.num_tokens,
            "loss_tokens": info.num_loss_tokens,
            **record,
            "lr": lr,
            "tokens_per_s": info.num_tokens / train_s,
            "computed_tokens": sum(computed_tokens(micro_batch, share) for micro_batch in micro_batches),
            "peak_memory_gib": peak_memory_gib(world.device),
            "wait_s": train_start - wait_start,
            "train_s": train_s,
            **({"borrowed_cores_s": idle.widened_s} if idle else {}),
            "save_s": time.perf_counter() - save_start,
        }
        if metrics:  # before the checkpoint: a run resumed from it keeps this record (later ones are dropped)
            metrics.write(record)
        if checkpoint_due(config.ckpt, step, config.max_steps):
            with progress.doing(f"writing checkpoint step {step}"):
                checkpointer.save(step)
            if world.is_main:
                prune_checkpoints(config.output_dir, config.ckpt.keep)
        logger.info(
            f"step {step} | reward {info.reward_mean:.4f} | loss {record['loss']:.4f} | tokens {info.num_tokens} "
            f"| grad_norm {record['grad_norm']:.3f} | mismatch_kl {record['mismatch_kl']:.2e} | {train_s:.2f}s"
        )
    if metrics:
        metrics.close()
