import torch
from transformers import AutoModelForCausalLM

from rl.protocol import MicroBatch, Sample
from trainer.loss import shifted_logprobs
from trainer.model import block_causal_mask, packed_logprobs


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([2, 3]))[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_packed_logprobs_equal_separate_forwards(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (7, 5, 9)]
    micro_batch = MicroBatch.pack([Sample(ids, [True] * len(ids), [0.0] * len(ids), 0.0, 0.0, 0) for ids in samples])
    packed = packed_logprobs(model, micro_batch, temperature=0.7)
    start = 0
    for ids in samples:
        ids = torch.tensor(ids)
        alone = shifted_logprobs(model(ids[None]).logits[0], ids, temperature=0.7)
        # position 0 of each sample is never trained (it is prompt): compare the rest
        torch.testing.assert_close(packed[start + 1 : start + len(ids)], alone[1:], atol=1e-5, rtol=1e-5)
        start += len(ids)
