"""Loading the policy and its forward pass over packed micro-batches (writing weights: ``trainer.export``)."""

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BitsAndBytesConfig,
    PreTrainedModel,
)

from contracts.errors import TridentError, first_line
from contracts.model_card import ModelCard
from contracts.protocol import MicroBatch
from contracts.sampling import NO_TRUNCATION, Truncation
from trainer.attention import packing, use_packed_attention
from trainer.config import CheckpointedPart, LoraConfig, TrainerModelConfig
from trainer.context_parallel import Shard, scores_of_the_row, shard_of
from trainer.moe.routing import configure_routers
from trainer.scoring import Entropy, ScoringHead, logged_entropy_rows, scoring, use_scoring_head
from trainer.shared_prefix import shared_layout
from trainer.vision import configure_vision_tower, image_inputs, unwrapped, vision_tower_name

if TYPE_CHECKING:  # peft: imported only by a run with a LoRA adapter (trainer.peft_model)
    from peft import PeftModel


def load_model(
    config: TrainerModelConfig, device: torch.device, compute_dtype: torch.dtype = torch.float32
) -> "PreTrainedModel | PeftModel":
    """The policy in train mode, with LoRA and activation checkpointing as configured.

    What trains is float32 (the master weights). Under LoRA the frozen base is held in ``compute_dtype`` (the
    adapter in float32: peft upcasts it), since it is never updated: half the memory in bfloat16; with
    ``load_in_4bit`` its linear layers are quantized to NF4 on ``device`` as they load (:func:`nf4_config`).
    """
    lora, in_4bit = config.experimental.lora, config.experimental.load_in_4bit
    dtype = compute_dtype if lora is not None else torch.float32
    model = pretrained(
        ModelCard.of(config.name),
        dtype=dtype,
        quantization_config=nf4_config(compute_dtype) if in_4bit else None,
        device_map={"": device} if in_4bit else None,  # quantized where it computes
    )
    if in_4bit:
        keep_training_layout(model)
    use_packed_forward(model)
    configure_routers(decoder_layers(model), config.moe, config.name)
    configure_vision_tower(model, config.vision_tower, config.name)
    if config.ac is not None:
        checkpoint_every(model, config.ac.freq, config.ac.part, config.ac.offload)
    if lora is not None:
        model = add_lora(model, lora, train_vision=config.vision_tower == "trained")
    return model.to(device).train()


def pretrained(card: ModelCard, **kwargs) -> PreTrainedModel:
    """The model of ``card``, loaded with ``kwargs``: a causal LM, or a vision-language model (Qwen3-VL) as
    transformers' image-text-to-text class, whose language model is a causal LM."""
    vision = card.hub().vision_language
    return (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(card.path, **kwargs)


def nf4_config(compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    """QLoRA's base: every linear layer but the output layer in 4-bit NormalFloat, in blocks of 64 weights whose
    scales are themselves quantized to 8 bits (double quantization), dequantized to ``compute_dtype`` to multiply."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def keep_training_layout(model: nn.Module) -> None:
    """Keep each 4-bit layer's weights in the layout training uses, in place.

    On a CPU with AVX-512 BF16, bitsandbytes repacks a 4-bit weight for a faster bfloat16 kernel at the layer's
    first forward in eval mode without gradients (the probe's) and keeps it repacked; that kernel has no backward,
    so later training steps would get no gradient through the layer. Eval and training then also compute alike.
    """
    from bitsandbytes.nn import Linear4bit  # imported for QLoRA only: it takes seconds (it loads torch._dynamo)

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def compute_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: its parameters' device, except under FSDP2's CPU offload, where they stay in CPU
    memory and each layer is gathered onto this process's GPU to run."""
    device = next(model.parameters()).device
    if device.type == "cpu" and isinstance(model, FSDPModule) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def decoder_layers(model: "PreTrainedModel | PeftModel") -> nn.ModuleList:
    """The transformer blocks of a decoder-only model, or of a vision-language model's language model (with or
    without a peft wrapper)."""
    return unwrapped(model).get_decoder().layers


def checkpoint_every(
    model: PreTrainedModel, freq: int, part: CheckpointedPart = "layer", offload: bool = False
) -> None:
    """Recompute the activations of decoder layers 0, freq, 2·freq, ... in the backward pass: the whole layer, or
    only its ``mlp`` or ``attention`` (``self_attn``); with ``offload`` (whole layers only) each such layer's input
    waits for the backward pass in host memory (:func:`checkpoint_from_host`)."""
    layers = decoder_layers(model)
    if part == "layer":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i % freq == 0
            if offload:
                layer._gradient_checkpointing_func = checkpoint_from_host
        return
    for layer in list(layers)[::freq]:
        recompute_in_backward(layer.mlp if part == "mlp" else layer.self_attn)


def checkpoint_from_host(function, hidden: Tensor, *args) -> Tensor:
    """``function(hidden, *args)`` (a decoder layer's forward, as transformers' checkpointed layers call it) under
    activation checkpointing, its input kept in host memory until the backward pass: what torch's checkpoint holds
    for the recomputation is a host copy of ``hidden`` (pinned, copied without waiting, on a GPU), moved back to the
    device inside the checkpointed function; the gradient flows back through both copies. Naive equivalent:
    ``checkpoint(function, hidden, *args, use_reentrant=False)``."""
    device = hidden.device
    held = hidden.to("cpu", non_blocking=device.type == "cuda")
    return checkpoint(
        lambda host, *rest: function(host.to(device, non_blocking=True), *rest), held, *args, use_reentrant=False
    )


def recompute_in_backward(module: nn.Module) -> None:
    """Make ``module`` keep only its inputs for the backward pass and recompute the rest there, in place (its
    parameters keep their names)."""
    module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def add_lora(model: PreTrainedModel, lora: LoraConfig, train_vision: bool = False) -> "PeftModel":
    """Freeze the model and wrap it with a trainable LoRA adapter (peft); a target that names nothing peft can adapt
    (a linear layer, or a fused expert weight, by its name or a dotted suffix of it) is a TridentError naming the
    model's linear layers.

    A target that names a fused expert weight itself (``experts.gate_up_proj``) and no linear layer adapts that
    weight (peft's ``target_parameters``); peft also converts ``gate_proj``, ``up_proj`` and ``down_proj`` to the
    experts' fused weights on a Qwen3-MoE, whose MLP has no such linear layers. A vision-language model's vision
    tower (:func:`~trainer.vision.vision_tower_name`) gets no adapter (peft's ``exclude_modules``) unless it trains
    (``train_vision``, ``model.vision_tower = 'trained'``): the targets name the language model's layers."""
    tower = None if train_vision else vision_tower_name(model)
    names = {name for name in lora_target_names(model) if tower is None or not name.startswith(f"{tower}.")}
    if missing := [t for t in lora.target_modules if not any(_names(n, t) for n in names)]:
        linears = ", ".join(sorted({name.split(".")[-1] for name in names}))
        raise TridentError(
            f"model.experimental.lora.target_modules: no linear layer {', '.join(map(repr, missing))} in the "
            f"{model.config.model_type} model; its linear layers: {linears}"
        )
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    fused = [f"{name}.{weight}" for name, module in model.named_modules() if not isinstance(module, nn.Linear)
             for weight, tensor in module.named_parameters(recurse=False) if tensor.dim() == 3]  # fmt: skip
    weights = [t for t in lora.target_modules
               if any(_names(n, t) for n in fused) and not any(_names(n, t) for n in linears)]  # fmt: skip
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[t for t in lora.target_modules if t not in weights] or None,
        target_parameters=weights or None,
        modules_to_save=lora.modules_to_save or None,
        exclude_modules=rf"{re.escape(tower)}\..*" if tower else None,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # e.g. one half of a fused expert weight targeted without the other
        raise TridentError(f"model.experimental.lora.target_modules: {first_line(str(e))}") from None


def _names(name: str, target: str) -> bool:
    """Whether the LoRA ``target`` names the layer or weight ``name``: the whole name or a dotted suffix of it, as
    peft matches."""
    return name == target or name.endswith(f".{target}")


def lora_target_names(model: nn.Module) -> set[str]:
    """What a LoRA target may name: each linear layer, and each fused expert weight of a mixture of experts, also by
    the names fused in it (peft adapts ``experts.gate_up_proj`` for ``gate_proj`` and ``up_proj``)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            names.add(name)
            continue
        for weight, _ in module.named_parameters(recurse=False):
            if weight.endswith("_proj"):
                parts = weight.removesuffix("_proj").split("_")
                names |= {f"{name}.{weight}", *(f"{name}.{part}_proj" for part in parts)}
    return names


def use_packed_forward(model: PreTrainedModel) -> PreTrainedModel:
    """Make ``model`` take packed micro-batches (attention within each sample, :mod:`trainer.attention`) and score
    tokens through its output layer in chunks (:mod:`trainer.scoring`), in place; returns it."""
    use_packed_attention(model)
    use_scoring_head(model)
    return model


class Scores(NamedTuple):
    """What :func:`packed_scores` returns, per token of the row."""

    logprobs: Float[Tensor, " seq"]
    entropy: Float[Tensor, " seq"]  # 0 where not computed
    entropy_mask: Bool[Tensor, " seq"]  # where ``entropy`` was computed (on the model's device)
    outside_kept: Float[Tensor, " seq"]  # 1 where the token lay outside the truncation's kept set (scored as kept)


def packed_scores(
    model: nn.Module,
    micro_batch: MicroBatch,
    temperature: float,
    positions: Bool[Tensor, " seq"] | None = None,
    entropy: Entropy = "off",
    truncation: Truncation = NO_TRUNCATION,
    output_dir: Path | None = None,
    group: dist.ProcessGroup | None = None,
    share: bool = False,
) -> Scores:
    """Logprob of each token given the ones before it in its sample, after temperature and the server's
    ``truncation`` (:mod:`trainer.truncation`), and the entropy of the distribution it was drawn from, at
    ``positions`` (all when None) and 0 elsewhere. The entropy is computed at every position for ``trained``, at a
    strided subset of them for ``logged`` (``entropy_mask`` says where).

    A sample's first token has no context and always gets 0. Only the kept positions go through the output
    layer, in chunks: no ``[tokens × vocab]`` tensor is made. Naive equivalent: ``log_softmax(logits[i - 1] /
    T)[input_ids[i]]`` with ``logits`` from a forward of the sample alone.

    With a context-parallel ``group``, every rank of it is given the same micro-batch: each runs the model on its
    :class:`~trainer.context_parallel.Shard` of the row (padded to a multiple of the group's size by a sample of
    padding) and scores the positions whose context ends in it; every rank returns the whole row's scores
    (:func:`~trainer.context_parallel.scores_of_the_row`), the same as without the group.

    A micro-batch with images (a vision-language model's) also goes in with its images' pixel values and its
    M-RoPE positions (:func:`~trainer.vision.image_inputs`), the images read from the run in ``output_dir``.

    With ``share`` (and no ``group`` or images), samples that begin alike have their shared beginning computed
    once (:mod:`trainer.shared_prefix`): the same scores, up to float rounding, for fewer tokens through the model.

    Everything decided from the micro-batch (which positions, the attention mask) is computed on the host from
    its CPU tensors and copied without waiting: nothing here waits for the device (but a vision tower, on the
    image grids).
    """
    if not any(isinstance(module, ScoringHead) for module in model.modules()):
        raise TypeError("packed_scores needs a model prepared by use_packed_forward (load_model does it)")
    device = compute_device(model)
    lengths, tokens = micro_batch.sample_lengths, len(micro_batch.input_ids)
    keep = torch.ones_like(micro_batch.loss_mask) if positions is None else positions.cpu().clone()
    keep[torch.cumsum(lengths, 0) - lengths] = False  # sample starts
    index = keep.nonzero()[:, 0]
    entropy_index = index if entropy == "trained" else index[logged_entropy_rows(len(index))]
    entropy_mask = torch.zeros_like(keep).index_fill(0, entropy_index, entropy != "off") & keep
    shard = shard_of(tokens, dist.get_rank(group), dist.get_world_size(group)) if group else Shard(0, tokens, tokens)
    padding = shard.padded - tokens
    mine = index[(index > shard.start) & (index <= shard.stop)]  # scored from this shard's hidden states
    logged_rows = logged_entropy_rows(len(index), int((index <= shard.start).sum()))
    weight = 1.0
    if len(mine) == 0:  # score one token with weight 0: backward (and its collectives) still runs on this rank
        mine, weight = torch.tensor([shard.start + 1]), 0.0
    # the row the model computes (with ``share``, shared beginnings once), the hidden state each position reads
    layout = shared_layout(micro_batch) if share and group is None and micro_batch.images is None else None
    computed = slice(shard.start, shard.stop) if layout is None else layout.order
    hidden_at = mine - 1 - shard.start if layout is None else layout.where[mine - 1]
    input_ids = F.pad(micro_batch.input_ids, (0, padding)).to(device, non_blocking=True)
    mine = mine.to(device, non_blocking=True)
    images, position_ids = image_inputs(model, micro_batch, output_dir), micro_batch.position_ids[None]
    pixels = {}
    if images is not None:
        position_ids = images.position_ids
        pixels = {"pixel_values": images.pixel_values.to(device, non_blocking=True),
                  "image_grid_thw": images.image_grid_thw.to(device, non_blocking=True)}  # fmt: skip
    if padding:
        lengths = torch.cat([lengths, torch.tensor([padding])])
        position_ids = torch.cat([position_ids, torch.arange(padding)[None]], -1)
    if layout is None:
        attention = packing(lengths, device, group)
    else:
        attention = packing(torch.tensor(layout.bounds).diff(), device, prefixes=layout.prefixes)
    targets = input_ids[mine.clamp(max=shard.padded - 1)]
    with scoring(targets, temperature, entropy, truncation, logged_rows):
        scores = model(
            input_ids=input_ids[None, computed if layout is None else computed.to(device, non_blocking=True)],
            position_ids=position_ids[..., computed].to(device, non_blocking=True),
            packing=attention,
            logits_to_keep=hidden_at.to(device, non_blocking=True),
            use_cache=False,  # no key/value cache: a checkpointed attention's recomputation would grow it
            **pixels,
        ).logits[0]
    row = scores.new_zeros(shard.padded + 1, 3).index_put((mine,), scores * weight)[:tokens]
    if group is not None:
        row = scores_of_the_row(row, group)
    return Scores(row[:, 0], row[:, 1], entropy_mask.to(device, non_blocking=True), row[:, 2].detach())


def packed_logprobs(
    model: nn.Module,
    micro_batch: MicroBatch,
    temperature: float,
    positions: Bool[Tensor, " seq"] | None = None,
    truncation: Truncation = NO_TRUNCATION,
    output_dir: Path | None = None,
    group: dist.ProcessGroup | None = None,
    share: bool = False,
) -> Float[Tensor, " seq"]:
    """Per-token logprobs (after temperature and truncation) of a packed micro-batch, as in :func:`packed_scores`."""
    scores = packed_scores(
        model,
        micro_batch,
        temperature,
        positions,
        truncation=truncation,
        output_dir=output_dir,
        group=group,
        share=share,
    )
    return scores.logprobs
