"""Activation offload (``[model.ac] offload``): a checkpointed layer's input waits for the backward pass in host
memory. Through the trainer (FSDP2 on one rank), two steps with offload train exactly as without, in full training and
under LoRA; the checkpoint torch runs for each such layer holds a host tensor, and what it saves for an input on a
(fake) CUDA device is a host copy, not the input. On a GPU (marked): the layer inputs
leave the device, which holds less at the forward pass's end."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from contracts.protocol import MicroBatch, Sample
from trainer import model as trainer_model
from trainer.config import TrainerConfig, TrainerModelConfig
from trainer.model import checkpoint_from_host, decoder_layers, load_model, packed_logprobs
from trainer.train import train

LORA = {"rank": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def run(output_dir, model_path, ac: dict, lora: dict | None) -> list[dict]:
    model = {"name": model_path, "ac": ac} | ({"experimental": {"lora": lora}} if lora else {})
    train(TrainerConfig(output_dir=output_dir, model=model, max_steps=2, optim={"lr": 1e-2}))
    return [json.loads(line) for line in (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_two_steps_with_offload_train_exactly_as_without(tmp_path, write_batches, tiny_model_path, lora):
    for name in ("kept", "offloaded"):
        write_batches(tmp_path / name)
    kept = run(tmp_path / "kept", tiny_model_path, {}, lora)
    offloaded = run(tmp_path / "offloaded", tiny_model_path, {"offload": True}, lora)
    for one, two in zip(kept, offloaded, strict=True):  # step 2 trains on step 1's update: the update matched too
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6, abs=1e-9)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6)


def test_each_checkpointed_layer_hands_torchs_checkpoint_a_host_copy_of_its_input(tiny_model_path, monkeypatch):
    model = load_model(TrainerModelConfig(name=tiny_model_path, ac={"freq": 2, "offload": True}), torch.device("cpu"))
    layers = decoder_layers(model)
    assert [layer._gradient_checkpointing_func is checkpoint_from_host for layer in layers] == [True, True]
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]  # freq 2: layer 0 only
    held = []

    def recording(function, *args, **kwargs):
        held.append(args[0].device)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(trainer_model, "checkpoint", recording)
    packed_logprobs(model, micro_batch(), temperature=1.0).sum().backward()
    assert held[:1] == [torch.device("cpu")]  # layer 0's input (the scoring head checkpoints its chunks after it)


def test_torchs_checkpoint_saves_a_host_copy_of_a_device_input_not_the_input():
    """What torch's checkpoint saves for the recomputation (seen by saved-tensor hooks around the call) is a host
    copy of the layer's input, not the input. The input sits on a fake CUDA device (a FakeTensor, no GPU needed): on
    the CPU a real tensor's host copy is the tensor itself, so only another device can tell a copy from none."""
    saved = []
    with FakeTensorMode():
        hidden = torch.empty(800, 64, device="cuda", requires_grad=True) * 1  # a layer's input, made on the device
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            output = checkpoint_from_host(lambda h, scale: h.sin() * scale, hidden, 2.0)
    assert [(t.device, t.shape, t.dtype) for t in saved] == [(torch.device("cpu"), hidden.shape, hidden.dtype)]
    assert saved[0] is not hidden
    assert output.device == hidden.device  # the function computed on the device, from the host copy moved back


def micro_batch() -> MicroBatch:
    """Two samples of 300 and 500 random tokens, every token trained."""
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (300, 500)]
    return MicroBatch.pack([Sample(s, [True] * len(s), [0.0] * len(s), 1.0, 0.0, 0) for s in ids])


@pytest.mark.gpu
def test_on_a_gpu_the_checkpointed_layers_inputs_leave_the_device(tiny_model_path, monkeypatch):
    device = torch.device("cuda")
    peaks, gradients = {}, {}
    for offload in (False, True):
        model = load_model(TrainerModelConfig(name=tiny_model_path, ac={"offload": offload}), device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        logprobs = packed_logprobs(model, micro_batch(), temperature=1.0)
        peaks[offload] = torch.cuda.memory_allocated() - before  # what the forward pass left for the backward pass
        logprobs.sum().backward()
        gradients[offload] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # each layer's input: 800 tokens x hidden 64 x 4 bytes (float32), two layers
    assert peaks[False] - peaks[True] >= 2 * 800 * 64 * 4
    for name, gradient in gradients[False].items():
        torch.testing.assert_close(gradients[True][name], gradient)
