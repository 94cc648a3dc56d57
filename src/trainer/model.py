"""Loading the policy, the packed forward pass, and writing weights for inference."""

from pathlib import Path

import torch
from jaxtyping import Bool, Int
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rl.protocol import MicroBatch, atomic_dir, mark_stable
from rl.tiny_model import resolve_model_path
from trainer.loss import shifted_logprobs


def load_model(name: str, device: torch.device) -> PreTrainedModel:
    """The policy in fp32 (the trainer's master weights), in train mode."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32)
    return model.to(device).train()


def block_causal_mask(sample_lengths: Int[Tensor, " samples"]) -> Bool[Tensor, "1 1 seq seq"]:
    """Causal attention that stays inside each packed sample: token i sees j iff j <= i in the same sample."""
    segment = torch.repeat_interleave(torch.arange(len(sample_lengths)), sample_lengths)
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


def save_weights(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write HF-format weights (with config and tokenizer) to ``folder`` atomically, ``STABLE`` last."""
    with atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        mark_stable(tmp)
