"""Packed attention: one kernel call per layer equals causal attention on each sample alone (the reference).

Varlen flash attention runs on CUDA only: on the CPU its call is checked against a stand-in that computes what
``torch.nn.attention.varlen.varlen_attn`` documents (each sequence of the cumulative lengths attends causally to
itself), for both of torch's signatures; the gpu-marked test runs the real kernel."""

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from varlen_stand_in import documented_varlen, varlen_packing

from contracts.protocol import MicroBatch, Sample
from trainer import attention
from trainer import model as trainer_model
from trainer.attention import PACKED_ATTENTION, Packing, packing
from trainer.config import LossConfig, TrainerModelConfig
from trainer.loss import policy_loss
from trainer.model import decoder_layers, load_model, packed_scores

REFERENCE = "trident_per_sample_sdpa"


def per_sample_sdpa(module, query, key, value, attention_mask, packing=None, **kwargs):
    """The reference: causal SDPA on each sample of the row alone, in a Python loop, concatenated."""
    bounds = packing.sample_bounds if packing is not None else (0, query.shape[2])
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kwargs
        )[0]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(REFERENCE, per_sample_sdpa)


def set_attention(model, name: str) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(name)


SIGNATURES = {  # the keywords of varlen_attn's signature in each torch release, and a stand-in taking only those
    "2.12+": ("scale", "window_size", "enable_gqa"),
    "2.11": ("scale", "window_size"),
    "2.10": ("is_causal",),
}


def varlen_of(release: str):
    """A stand-in of varlen_attn as ``release`` has it: other keywords are refused, and without ``enable_gqa`` so
    are fewer key/value heads."""
    keywords = SIGNATURES[release]

    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        assert set(kwargs) <= set(keywords), f"torch {release} takes no {set(kwargs) - set(keywords)}"
        assert "enable_gqa" in keywords or key.shape[1] == query.shape[1], f"no GQA in torch {release}"
        return documented_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    return varlen


@pytest.fixture
def cpu_varlen(monkeypatch):
    """Varlen attention on the CPU: the documented stand-in for the kernel, taken for fp32 too."""
    monkeypatch.setattr(attention, "varlen_attn", documented_varlen)
    monkeypatch.setattr(attention, "VARLEN_DTYPES", (torch.float32, torch.bfloat16))
    monkeypatch.setattr(trainer_model, "packing", varlen_packing)


def test_packing_keeps_the_bounds_on_the_host_and_the_cpu_needs_no_kernel_tensor():
    packed = packing(torch.tensor([2, 3, 1]), torch.device("cpu"))
    assert packed == Packing((0, 2, 5, 6)) and packed.cumulative is None
    assert set(SIGNATURES["2.12+"]) <= set(attention.VARLEN_PARAMETERS)  # the pinned torch's signature


@pytest.mark.parametrize("release", SIGNATURES)
@pytest.mark.parametrize("lengths", [(100, 200, 37), (5, 1, 130, 64)])
def test_varlen_and_per_sample_kernels_equal_the_reference_loop(monkeypatch, release, lengths):
    """One varlen call (each of torch's signatures) and the per-sample loop against the reference, with
    grouped-query attention (4 query heads, 2 key/value heads) and a scale other than the kernel's own."""
    monkeypatch.setattr(attention, "varlen_attn", varlen_of(release))
    monkeypatch.setattr(attention, "VARLEN_PARAMETERS", dict.fromkeys(SIGNATURES[release]))
    generator = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    query = torch.randn(1, 4, tokens, 16, generator=generator, dtype=torch.bfloat16)
    key, value = (torch.randn(1, 2, tokens, 16, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    sample_lengths = torch.tensor(lengths)
    scaling = 0.3
    cpu = torch.device("cpu")
    expected = per_sample_sdpa(module, query, key, value, None, packing(sample_lengths, cpu), scaling=scaling)[0]
    for packed in (varlen_packing(sample_lengths, torch.device("cpu")), packing(sample_lengths, torch.device("cpu"))):
        got = attention.packed_attention(module, query, key, value, None, packed, scaling=scaling)[0]
        assert got.shape == (1, tokens, 4, 16)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


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
    device = scores.logprobs.device
    loss, _ = policy_loss(
        scores.logprobs, micro_batch.inference_logprobs.to(device), micro_batch.advantages.to(device),
        micro_batch.loss_mask.to(device), micro_batch.sample_lengths, LossConfig(entropy_coef=0.01),
        num_loss_tokens=50, num_samples=4, entropy=scores.entropy,
    )  # fmt: skip
    if backward:
        loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach(), loss.detach(), gradients


@pytest.mark.parametrize("kernel", ["per_sample", "varlen"])
@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}])
def test_packed_forward_gives_the_per_sample_loops_logprobs_loss_and_gradients(tiny_model_path, request, kernel, lora):
    """The tiny model (grouped-query attention: 2 heads, 1 key/value head) in fp32, four packed samples."""
    if kernel == "varlen":
        request.getfixturevalue("cpu_varlen")
    config = TrainerModelConfig(name=tiny_model_path, experimental={"lora": lora} if lora else {})
    model = load_model(config, torch.device("cpu"))
    if lora:  # a trained adapter, so that it changes the attention's inputs
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.1)
    micro_batch = tiny_micro_batch()
    got = loss_and_gradients(model, micro_batch)
    set_attention(model, REFERENCE)
    expected = loss_and_gradients(model, micro_batch)
    torch.testing.assert_close(got[0], expected[0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[1], expected[1], atol=1e-3, rtol=1e-3)
    assert got[2].keys() == expected[2].keys() and got[2]
    for name in expected[2]:
        torch.testing.assert_close(got[2][name], expected[2][name], atol=1e-3, rtol=1e-3)


def test_attention_runs_once_per_layer_per_micro_batch(tiny_model_path, monkeypatch, cpu_varlen):
    """On the GPU's path: one attention call per layer, one varlen kernel call in it, and the packing made once for
    all layers."""
    calls = {"attention": 0, "kernel": 0, "packing": 0}

    def counting(name, function):
        def count(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return count

    monkeypatch.setitem(
        AttentionInterface._global_mapping, PACKED_ATTENTION, counting("attention", attention.packed_attention)
    )
    monkeypatch.setattr(attention, "varlen_attn", counting("kernel", attention.varlen_attn))
    monkeypatch.setattr(trainer_model, "packing", counting("packing", trainer_model.packing))
    model = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    packed_scores(model, tiny_micro_batch(), 1.0).logprobs.sum().backward()
    layers = len(decoder_layers(model))
    assert calls == {"attention": layers, "kernel": layers, "packing": 1}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


@pytest.mark.gpu
def test_varlen_attention_on_gpu_equals_the_per_sample_loop(tiny_model_path):
    """On CUDA in bf16 the model attends with one varlen flash-attention call per layer: the logprobs, loss and
    gradients of the per-sample loop, to bf16's precision."""
    device = torch.device("cuda")
    model = load_model(TrainerModelConfig(name=tiny_model_path), device).to(torch.bfloat16)
    micro_batch = tiny_micro_batch()
    assert packing(micro_batch.sample_lengths, device).cumulative.is_cuda
    got = loss_and_gradients(model, micro_batch)
    set_attention(model, REFERENCE)
    expected = loss_and_gradients(model, micro_batch)
    assert relative_error(got[0], expected[0]) < 1e-2 and relative_error(got[1], expected[1]) < 1e-2
    assert got[2].keys() == expected[2].keys()
    for name in expected[2]:
        assert relative_error(got[2][name], expected[2][name]) < 2e-2, name
