"""For the weight handover tests: three tensors named, shaped and typed as a model's (float32 and bfloat16), what
receivers take from a trainer's broadcast, and a training step at full fine-tuning's learning rate."""

import threading

import torch

from inference.transports.process_group import ProcessGroupReceiver

LR = 1e-5  # of full fine-tuning

TENSORS = {
    "model.embed_tokens.weight": torch.randn(5, 3),
    "model.layers.0.mlp.up_proj.weight": torch.randn(4, 3, dtype=torch.bfloat16),
    "model.norm.weight": torch.ones(3),
}


def take(manifest: dict, receivers: list[ProcessGroupReceiver]) -> list[list | None]:
    """What each of ``receivers`` gets when asked to load ``manifest``'s weights, all at once (as the orchestrator
    reloads every server), as lists of (name, values)."""
    got: list = [None] * len(receivers)

    def one(i: int) -> None:
        tensors = receivers[i].take(manifest, torch.device("cpu"))
        got[i] = None if tensors is None else [(name, tensor.tolist()) for name, tensor in tensors]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(receivers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return got


def train_step(model, optimizer, seed: int) -> None:
    """One AdamW step on a language-model loss over random tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
