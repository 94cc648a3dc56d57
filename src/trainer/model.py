"""Loading the policy, the packed forward pass, and writing weights for inference."""

from pathlib import Path

import torch
import torch.distributed as dist
from jaxtyping import Bool, Float, Int
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rl.broadcast import Sender, write_manifest
from rl.protocol import PROBE_TEXT, MicroBatch, Sample, atomic_dir, mark_stable, write_probe
from rl.tiny_model import resolve_model_path
from trainer.config import LoraConfig, LoraExport, TrainerModelConfig
from trainer.loss import sample_segments, shifted_logprobs


def load_model(config: TrainerModelConfig, device: torch.device) -> PreTrainedModel | PeftModel:
    """The policy in fp32 (the trainer's master weights), in train mode, with LoRA and activation checkpointing
    as configured."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(config.name), dtype=torch.float32)
    if config.ac is not None:
        checkpoint_every(model, config.ac.freq)
    if config.experimental.lora is not None:
        model = add_lora(model, config.experimental.lora)
    return model.to(device).train()


def decoder_layers(model: PreTrainedModel | PeftModel) -> nn.ModuleList:
    """The transformer blocks of a decoder-only model (with or without a peft wrapper)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return base.model.layers


def checkpoint_every(model: PreTrainedModel, freq: int) -> None:
    """Recompute the activations of decoder layers 0, freq, 2·freq, ... in the backward pass."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(decoder_layers(model)):
        layer.gradient_checkpointing = i % freq == 0


def add_lora(model: PreTrainedModel, lora: LoraConfig) -> PeftModel:
    """Freeze the model and wrap it with a trainable LoRA adapter (peft)."""
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save or None,
    )
    return get_peft_model(model, config)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded weights, on CPU, on rank 0 (other ranks get ``{}``); every rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def untied(state: dict[str, Tensor], model: PreTrainedModel) -> dict[str, Tensor]:
    """``state`` without the weights the model ties to another one (e.g. ``lm_head`` to the embeddings).

    Gathered from shards, tied weights are separate tensors that ``save_pretrained`` would write twice.
    """
    return {name: tensor for name, tensor in state.items() if name not in model.all_tied_weights_keys}


def merge_lora(state: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """The base model's weights with the adapter merged in, under the base model's own names.

    ``state`` is a peft model's state dict: each adapted layer keeps its weight ``W`` under ``base_layer`` next
    to ``lora_A`` (A) and ``lora_B`` (B), and becomes ``W + scaling · B @ A``; a module to save replaces its
    ``original_module`` by its trained copy.
    """
    merged = {}
    for name, tensor in state.items():
        if "lora_" in name or ".original_module." in name:
            continue
        if ".base_layer." in name and name.endswith(".weight"):
            layer = name.removesuffix(".base_layer.weight")
            lora_a, lora_b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
            tensor = tensor + scaling * (lora_b.to(tensor.dtype) @ lora_a.to(tensor.dtype))
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        merged[name.replace(".modules_to_save.default.", ".")] = tensor
    return merged


def block_causal_mask(sample_lengths: Int[Tensor, " samples"]) -> Bool[Tensor, "1 1 seq seq"]:
    """Causal attention that stays inside each packed sample: token i sees j iff j <= i in the same sample."""
    segment = sample_segments(sample_lengths)
    n = len(segment)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (causal & (segment[:, None] == segment[None, :]))[None, None]


def packed_logits(model: nn.Module, micro_batch: MicroBatch, device: torch.device) -> Float[Tensor, "seq vocab"]:
    """The logits of a packed micro-batch in which each sample sees only itself."""
    return model(
        input_ids=micro_batch.input_ids[None].to(device),
        position_ids=micro_batch.position_ids[None].to(device),
        attention_mask=block_causal_mask(micro_batch.sample_lengths).to(device),
    ).logits[0]


def packed_logprobs(model: nn.Module, micro_batch: MicroBatch, temperature: float) -> Float[Tensor, " seq"]:
    """Per-token logprobs (after temperature) of a packed micro-batch; each sample sees only itself."""
    device = next(model.parameters()).device
    # Position 0 of each sample has no context: its logprob is never trained (it is prompt).
    return shifted_logprobs(packed_logits(model, micro_batch, device), micro_batch.input_ids.to(device), temperature)


def probe_logprobs(model: PreTrainedModel | PeftModel, token_ids: list[int]) -> list[float]:
    """Logprob of each token given the ones before it (temperature 1; 0.0 at position 0), in eval mode."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        sample = Sample(token_ids, [True] * len(token_ids), [0.0] * len(token_ids), 0.0, 0.0, 0)
        logprobs = packed_logprobs(model, MicroBatch.pack([sample]), temperature=1.0)
    model.train(was_training)
    return [0.0, *logprobs[1:].tolist()]


def save_weights(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    export: LoraExport = "merged",
    sender: Sender | None = None,
) -> None:
    """Write weights for inference to ``folder`` atomically, ``STABLE`` last; every rank calls it, rank 0 writes.

    Full training writes HF-format weights. A LoRA model writes its adapter merged into the base weights
    (``export = "merged"``: full weights any server can load) or the adapter alone (``"adapter"``: peft's
    format, for a server that swaps adapters). With a ``sender`` (rank 0's end of the weight broadcast) the
    folder holds the broadcast's manifest instead of full weights, and the weights are sent in the background
    once it is complete (after the previous weights were received). The probe's logprobs under these weights go with
    them, so that whoever loads them can check it serves exactly these weights.
    """
    state = full_state_dict(model)
    probe_ids = tokenizer.encode(PROBE_TEXT)
    probe = probe_logprobs(model, probe_ids)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    adapter = isinstance(model, PeftModel) and export == "adapter"
    owner, weights = (model, state) if adapter else full_weights(model, state)
    if sender is not None:
        sender.wait()  # the server took the previous weights: these become the newest
    with atomic_dir(folder) as tmp:
        if sender is not None:
            write_manifest(tmp, sender.manifest(weights))
        else:
            owner.save_pretrained(tmp, state_dict=weights)  # a PeftModel saves its adapter's weights only
        tokenizer.save_pretrained(tmp)
        write_probe(tmp, probe_ids, probe)
        mark_stable(tmp)
    if sender is not None:
        sender.send(weights)


def full_weights(model: PreTrainedModel | PeftModel, state: dict[str, Tensor]) -> tuple[PreTrainedModel, dict]:
    """The model's full weights for inference under the base model's names, from its gathered ``state`` (a LoRA
    adapter merged in, tied copies left out), and the model that saves them."""
    if isinstance(model, PeftModel):
        lora, base = model.peft_config["default"], model.get_base_model()
        return base, untied(merge_lora(state, lora.lora_alpha / lora.r), base)
    return model, untied(state, model)
