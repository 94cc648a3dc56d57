"""Random training batches on disk, as the orchestrator writes them, for the trainer's tests."""

import torch

from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_samples, write_batch


def random_samples(num_samples: int, seed: int = 0) -> list[Sample]:
    """Samples of 20–60 random tokens whose last two thirds were "sampled" with logprobs near the tiny model's."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num_samples):
        length = int(torch.randint(20, 60, (1,), generator=generator))
        prompt = length // 3
        token_ids = torch.randint(0, 2000, (length,), generator=generator).tolist()
        logprobs = (-7.6 + 0.05 * torch.randn(length - prompt, generator=generator)).tolist()
        advantage = float(torch.randn(1, generator=generator))
        samples.append(Sample(token_ids, [False] * prompt + [True] * (length - prompt), [0.0] * prompt + logprobs,
                              advantage, 0.0, 0))  # fmt: skip
    return samples


def write_random_batches(output_dir, steps: int = 2, num_samples: int = 10, seq_len: int = 128) -> int:
    """Write the same random batch for steps 1..steps under ``output_dir``, packed into ``seq_len`` tokens; the
    number of micro-batches."""
    samples = random_samples(num_samples)
    micro_batches = [MicroBatch.pack(bin) for bin in pack_samples(samples, seq_len)]
    num_tokens = sum(len(s.token_ids) for s in samples)
    num_loss_tokens = sum(sum(s.loss_mask) for s in samples)
    for step in range(1, steps + 1):
        write_batch(output_dir, BatchInfo(step, num_samples, num_tokens, num_loss_tokens, 0.0, 1.0), micro_batches)
    return len(micro_batches)
