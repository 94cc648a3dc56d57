"""Regional compilation of the decoder layers (model.compile): no graph break in a training step's layers, and
the same loss and gradients as the eager model, with LoRA and with activation checkpointing.

On CPU the layers are compiled with the ``aot_eager`` backend: Dynamo captures each layer's forward and AOTAutograd
its backward, as for inductor, but the captured graphs run as eager ops (inductor's C++ build of the same graphs
takes minutes on two cores). The GPU test compiles with inductor, as the trainer does.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from contracts.protocol import BatchInfo, MicroBatch
from trainer.config import TrainerConfig
from trainer.model import compile_layers
from trainer.optim import build_optimizer
from trainer.train import build_model, compiles, train_step


def step(config, world, micro_batch, backend=None):
    """Loss and gradients of one train_step of the policy as loaded, its layers compiled with ``backend``."""
    torch.manual_seed(0)  # LoRA's A
    model = build_model(config.model, world, offload=False)
    if backend:
        compile_layers(model, backend)
    optimizer, _ = build_optimizer(model, config.optim, 10)
    tokens = int(micro_batch.loss_mask.sum())
    info = BatchInfo(0, len(micro_batch.sample_lengths), len(micro_batch.input_ids), tokens, 0.0, 1.0)
    metrics = train_step(model, optimizer, [(micro_batch, 1.0)], info, config, world)
    return metrics["loss"], {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "model",
    [{"ac": {"freq": 2}}, {"ac": {"part": "mlp"}, "experimental": {"lora": {"rank": 4, "target_modules": ["q_proj",
     "v_proj", "down_proj"]}}}],
    ids=["full-ac-layer", "lora-ac-mlp"],
)  # fmt: skip
def test_compiled_layers_have_no_graph_break_and_train_as_eager(world, random_samples, tiny_model_path, model):
    config = TrainerConfig(model={"name": tiny_model_path, "compile": False, **model}, loss={"entropy_coef": 0.01})
    micro_batch = MicroBatch.pack(random_samples(3))
    torch._dynamo.reset()
    counters.clear()
    compiled_loss, compiled_grads = step(config, world, micro_batch, backend="aot_eager")
    assert counters["stats"]["unique_graphs"] >= 1  # the layers were captured ...
    assert dict(counters["graph_break"]) == {}  # ... whole
    eager_loss, eager_grads = step(config, world, micro_batch)
    assert compiled_loss == pytest.approx(eager_loss, abs=1e-3, rel=1e-3)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-3, rtol=1e-3)


def test_compile_is_on_by_default_only_where_attention_is_one_varlen_call(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert not compiles("auto", cpu, torch.float32)
    assert not compiles("auto", gpu, torch.float32)  # per-sample attention: each packing compiles anew
    assert compiles(True, cpu, torch.float32) and not compiles(False, gpu, torch.bfloat16)
    monkeypatch.setattr("trainer.attention.varlen_attn", lambda *args, **kwargs: None)  # as torch >= 2.10 has
    assert compiles("auto", gpu, torch.bfloat16)
    monkeypatch.setattr("trainer.attention.varlen_attn", None)  # torch < 2.10
    assert not compiles("auto", gpu, torch.bfloat16)


@pytest.mark.gpu
def test_inductor_compiled_layers_on_a_gpu_train_as_eager_across_packings(world, random_samples, tiny_model_path):
    config = TrainerConfig(model={"name": tiny_model_path, "ac": {"part": "mlp"}, "compile": False})
    torch._dynamo.reset()
    counters.clear()
    for seed in range(3):  # three packings of different lengths
        micro_batch = MicroBatch.pack(random_samples(4, seed=seed))
        compiled_loss, compiled_grads = step(config, world, micro_batch, backend="inductor")
        eager_loss, eager_grads = step(config, world, micro_batch)
        assert compiled_loss == pytest.approx(eager_loss, abs=1e-3, rel=1e-2)  # bf16
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, atol=2e-2, rtol=5e-2)
    assert dict(counters["graph_break"]) == {}
