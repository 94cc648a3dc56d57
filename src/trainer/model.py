"""Loading the policy, the packed forward pass, and writing weights for inference."""

from pathlib import Path

import torch
from jaxtyping import Bool, Int
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rl.protocol import PROBE_TEXT, MicroBatch, Sample, atomic_dir, mark_stable, write_probe
from rl.tiny_model import resolve_model_path
from trainer.config import LoraConfig, TrainerModelConfig
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


def checkpoint_every(model: PreTrainedModel, freq: int) -> None:
    """Recompute the activations of decoder layers 0, freq, 2·freq, ... in the backward pass."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(model.model.layers):
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


def merged_state_dict(model: PeftModel) -> dict[str, Tensor]:
    """The base model's weights with the adapter merged in, under the base model's own names."""
    model.merge_adapter()
    try:
        state = model.get_base_model().state_dict()
        # peft keeps a wrapped layer's weights under `base_layer` and the trained copy of a module to save under
        # `modules_to_save.default` (next to the untouched `original_module`)
        return {
            name.replace(".base_layer.", ".").replace(".modules_to_save.default.", "."): tensor.detach().clone()
            for name, tensor in state.items()
            if "lora_" not in name and ".original_module." not in name
        }
    finally:
        model.unmerge_adapter()


def block_causal_mask(sample_lengths: Int[Tensor, " samples"]) -> Bool[Tensor, "1 1 seq seq"]:
    """Causal attention that stays inside each packed sample: token i sees j iff j <= i in the same sample."""
    segment = sample_segments(sample_lengths)
    n = len(segment)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (causal & (segment[:, None] == segment[None, :]))[None, None]


def packed_logprobs(model: PreTrainedModel, micro_batch: MicroBatch, temperature: float) -> Tensor:
    """Per-token logprobs (after temperature) of a packed micro-batch; each sample sees only itself."""
    device = model.device
    logits = model(
        input_ids=micro_batch.input_ids[None].to(device),
        position_ids=micro_batch.position_ids[None].to(device),
        attention_mask=block_causal_mask(micro_batch.sample_lengths).to(device),
    ).logits[0]
    # Position 0 of each sample has no context: its logprob is never trained (it is prompt).
    return shifted_logprobs(logits, micro_batch.input_ids.to(device), temperature)


def probe_logprobs(model: PreTrainedModel | PeftModel, token_ids: list[int]) -> list[float]:
    """Logprob of each token given the ones before it (temperature 1; 0.0 at position 0), in eval mode."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        sample = Sample(token_ids, [True] * len(token_ids), [0.0] * len(token_ids), 0.0, 0.0, 0)
        logprobs = packed_logprobs(model, MicroBatch.pack([sample]), temperature=1.0)
    model.train(was_training)
    return [0.0, *logprobs[1:].tolist()]


def save_weights(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write HF-format weights (with config and tokenizer) to ``folder`` atomically, ``STABLE`` last.

    A LoRA model is written merged, as full weights any server can load. The probe's logprobs under these
    weights go with them, so that whoever loads them can check it serves exactly these weights.
    """
    with atomic_dir(folder) as tmp:
        if isinstance(model, PeftModel):
            model.get_base_model().save_pretrained(tmp, state_dict=merged_state_dict(model))
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        probe_ids = tokenizer.encode(PROBE_TEXT)
        write_probe(tmp, probe_ids, probe_logprobs(model, probe_ids))
        mark_stable(tmp)
