"""Packed attention: one kernel call per layer equals causal attention on each sample alone (the reference)."""

import functools

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rl.protocol import MicroBatch, Sample
from trainer import attention
from trainer import model as trainer_model
from trainer.attention import PACKED_ATTENTION, document_block_mask, document_causal, packing
from trainer.config import LossConfig, TrainerModelConfig
from trainer.loss import policy_loss, sample_segments
from trainer.model import decoder_layers, load_model, packed_scores

REFERENCE = "trident_per_sample_sdpa"


def per_sample_sdpa(module, query, key, value, attention_mask, packing=None, **kwargs):
    """The reference: causal SDPA on each sample of the row alone, in a Python loop, concatenated."""
    bounds = packing.sample_bounds if packing is not None else (0, query.shape[2])
    outputs = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True)[0]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(REFERENCE, per_sample_sdpa)


def set_attention(model, name: str) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(name)


def test_document_causal_mask_hand_made():
    document = sample_segments(torch.tensor([2, 3]))
    assert document.tolist() == [0, 0, 1, 1, 1]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(create_mask(document_causal(document), None, None, 5, 5, device="cpu")[0, 0], expected)


def test_document_block_mask_skips_the_blocks_across_samples():
    """Two samples of 256 tokens, 128-token blocks: the second sample's queries see none of the first's keys."""
    mask = document_block_mask(sample_segments(torch.tensor([256, 256])), torch.device("cpu"))
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask.to_dense()[0, 0].bool(), expected)


@pytest.mark.parametrize("lengths", [(256, 256), (100, 200, 37), (5, 1, 130, 64), (300,), (128, 128, 1, 400)])
def test_document_block_mask_equals_flex_attentions_own(lengths):
    """The blocks computed from the samples' ids equal those ``create_block_mask`` finds by evaluating the mask at
    every query-key pair: which are partial, which full, and in what order."""
    document = sample_segments(torch.tensor(lengths))
    got = document_block_mask(document, torch.device("cpu"))
    expected = create_block_mask(document_causal(document), None, None, len(document), len(document), device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), msg=name)
    for name, counts in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
        for row, count in enumerate(getattr(expected, counts)[0, 0].tolist()):
            assert getattr(got, name)[0, 0, row, :count].tolist() == getattr(expected, name)[0, 0, row, :count].tolist()
    assert got.seq_lengths == expected.seq_lengths


@pytest.mark.parametrize("lengths", [(100, 200, 37), (5, 1, 130, 64)])
def test_flex_and_per_sample_kernels_equal_the_reference_loop(lengths):
    """The GPU's kernel (FlexAttention with the document BlockMask, run uncompiled here) and the CPU's (SDPA per
    sample) against the reference loop, with grouped-query attention (4 query heads, 2 key/value heads) and
    samples that straddle the 128-token blocks."""
    generator = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    query = torch.randn(1, 4, tokens, 16, generator=generator)
    key, value = (torch.randn(1, 2, tokens, 16, generator=generator) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    sample_lengths = torch.tensor(lengths)
    expected = per_sample_sdpa(module, query, key, value, None, packing(sample_lengths, torch.device("cpu")))[0]
    for kernel in ("per_sample", "flex"):
        packed = packing(sample_lengths, torch.device("cpu"), kernel)
        got = attention.packed_attention(module, query, key, value, None, packed, scaling=16**-0.5)[0]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def tiny_micro_batch() -> MicroBatch:
    generator = torch.Generator().manual_seed(3)
    samples = []
    for n in (17, 5, 30, 11):
        ids = torch.randint(0, 2000, (n,), generator=generator).tolist()
        logprobs = (-7.6 + 0.1 * torch.randn(n, generator=generator)).tolist()
        advantage = float(torch.randn(1, generator=generator))
        samples.append(Sample(ids, [i >= 3 for i in range(n)], logprobs, advantage, 0.0, 0))
    return MicroBatch.pack(samples)


def loss_and_gradients(model, micro_batch, backward: bool = True):
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        scores = packed_scores(model, micro_batch, 0.8, micro_batch.loss_mask, "trained" if backward else "logged")
    loss, _ = policy_loss(
        scores.logprobs, micro_batch.inference_logprobs, micro_batch.advantages, micro_batch.loss_mask,
        micro_batch.sample_lengths, LossConfig(entropy_coef=0.01), num_loss_tokens=50, num_samples=4,
        entropy=scores.entropy,
    )  # fmt: skip
    if backward:
        loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach(), loss.detach(), gradients


@pytest.mark.parametrize("kernel", ["per_sample", "flex"])
@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}])
def test_packed_forward_gives_the_per_sample_loops_logprobs_loss_and_gradients(
    tiny_model_path, monkeypatch, kernel, lora
):
    """The tiny model (grouped-query attention: 2 heads, 1 key/value head) in fp32, four packed samples.
    Uncompiled FlexAttention has no backward on CPU: its gradients are compared on GPU only."""
    monkeypatch.setattr(trainer_model, "packing", functools.partial(packing, kernel=kernel))
    config = TrainerModelConfig(name=tiny_model_path, experimental={"lora": lora} if lora else {})
    model = load_model(config, torch.device("cpu"))
    if lora:  # a trained adapter, so that it changes the attention's inputs
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.1)
    micro_batch = tiny_micro_batch()
    got = loss_and_gradients(model, micro_batch, backward=kernel == "per_sample")
    set_attention(model, REFERENCE)
    expected = loss_and_gradients(model, micro_batch, backward=kernel == "per_sample")
    torch.testing.assert_close(got[0], expected[0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[1], expected[1], atol=1e-3, rtol=1e-3)
    assert got[2].keys() == expected[2].keys() and (bool(got[2]) == (kernel == "per_sample"))
    for name in expected[2]:
        torch.testing.assert_close(got[2][name], expected[2][name], atol=1e-3, rtol=1e-3)


def test_attention_runs_once_per_layer_per_micro_batch(tiny_model_path, monkeypatch):
    """With FlexAttention (the GPU's path; forward only on CPU): one attention call per layer, one flex kernel
    call in it, and the BlockMask built once for all layers."""
    calls = {"attention": 0, "kernel": 0, "mask": 0}

    def counting(name, function):
        def count(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return count

    monkeypatch.setitem(
        AttentionInterface._global_mapping, PACKED_ATTENTION, counting("attention", attention.packed_attention)
    )
    monkeypatch.setattr(attention, "flex_attention", counting("kernel", attention.flex_attention))
    monkeypatch.setattr(attention, "document_block_mask", counting("mask", attention.document_block_mask))
    monkeypatch.setattr(trainer_model, "packing", functools.partial(packing, kernel="flex"))
    model = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    with torch.no_grad():
        packed_scores(model, tiny_micro_batch(), 1.0)
    layers = len(decoder_layers(model))
    assert calls == {"attention": layers, "kernel": layers, "mask": 1}


@pytest.mark.gpu
def test_compiled_flex_attention_on_gpu_equals_the_per_sample_loop(tiny_model_path):
    """On CUDA the model attends with compiled FlexAttention and its document BlockMask: same logprobs, loss and
    gradients as the loop in fp32."""
    device = torch.device("cuda")
    model = load_model(TrainerModelConfig(name=tiny_model_path), device)
    micro_batch = tiny_micro_batch()
    assert isinstance(packing(micro_batch.sample_lengths, device).mask, BlockMask)
    got = loss_and_gradients(model, micro_batch)
    assert attention.compiled_flex_attention.cache_info().currsize == 1  # the compiled kernel ran
    set_attention(model, REFERENCE)
    expected = loss_and_gradients(model, micro_batch)
    for g, e in zip(got[:2], expected[:2], strict=True):
        torch.testing.assert_close(g, e, atol=1e-3, rtol=1e-3)
    for name in expected[2]:
        torch.testing.assert_close(got[2][name], expected[2][name], atol=1e-3, rtol=1e-3)
