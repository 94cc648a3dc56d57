"""Regional compilation of the decoder layers (model.compile): no graph break in a training step's layers, and
the same loss and gradients as the eager model, with LoRA and with activation checkpointing; where compiling fails
or breaks a layer's graph, one warning and the eager model's step; ``compile = true`` where it compiles each
packing anew warns.

On CPU the layers are compiled with the ``aot_eager`` backend: Dynamo captures each layer's forward and AOTAutograd
its backward, as for inductor, but the captured graphs run as eager ops (inductor's C++ build of the same graphs
takes minutes on two cores). The GPU test compiles with inductor, as the trainer does.
"""

import logging
import math

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from contracts.protocol import BatchInfo, MicroBatch
from trainer.compilation import compile_layers, compiles
from trainer.config import TrainerConfig, TrainerModelConfig
from trainer.model import decoder_layers
from trainer.optim import build_optimizer
from trainer.train import build_model, train_step, warn_on_compile_setting


def step(config, world, micro_batch, backend=None, prepare=lambda model: None):
    """Loss and gradients of one train_step of the policy as loaded (and changed by ``prepare``), its layers
    compiled with ``backend`` (still compiled after the step: no fallback to eager)."""
    model, optimizer, metrics = stepped_model(config, world, micro_batch, backend, prepare)
    assert all((layer._compiled_call_impl is not None) == bool(backend) for layer in decoder_layers(model))
    return metrics["loss"], {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}


def stepped_model(config, world, micro_batch, backend=None, prepare=lambda model: None):
    """The model, its optimizer and the metrics after one train_step, as in :func:`step`."""
    torch.manual_seed(0)  # LoRA's A
    model = build_model(config.model, world, offload=False)
    prepare(model)
    if backend:
        compile_layers(model, backend)
    optimizer, _ = build_optimizer(model, config.optim, 10)
    tokens = int(micro_batch.loss_mask.sum())
    info = BatchInfo(0, len(micro_batch.sample_lengths), len(micro_batch.input_ids), tokens, 0.0, 1.0)
    metrics = train_step(model, optimizer, [(micro_batch, 1.0)], info, config, world)
    return model, optimizer, metrics


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
    assert not compiles("auto", gpu, torch.bfloat16, ep=2)  # the experts' all-to-all breaks the graph
    monkeypatch.setattr("trainer.attention.varlen_attn", None)  # torch < 2.10
    assert not compiles("auto", gpu, torch.bfloat16)


@pytest.mark.gpu
def test_inductor_compiles_the_layers_on_a_gpu_whole_across_packings(world, random_samples, tiny_model_path):
    config = TrainerConfig(model={"name": tiny_model_path, "ac": {"part": "mlp"}, "compile": False})
    torch._dynamo.reset()
    counters.clear()
    for seed in range(3):  # three packings of different lengths; step() checks the layers stayed compiled
        loss, grads = step(config, world, MicroBatch.pack(random_samples(4, seed=seed)), backend="inductor")
        assert math.isfinite(loss) and all(grad.isfinite().all() for grad in grads.values())
    assert dict(counters["graph_break"]) == {}


@pytest.mark.gpu
@pytest.mark.xfail(
    strict=True,
    reason="on an H100 (torch 2.11, 2026-11-27) the first packing's inductor-compiled bf16 loss was 1.1 % from the "
    "float32 step's, the eager bf16 loss 0.01 % (later packings: both within 0.03 %); not yet explained",
)
def test_inductor_compiled_bf16_steps_are_as_close_to_float32_as_eager_ones(world, random_samples, tiny_model_path):
    """bf16 rounds differently in inductor's fused kernels than in eager ops, so both bf16 steps are held against the
    float32 eager step: the compiled one may be at most twice as far from it as the eager one."""
    model = {"name": tiny_model_path, "ac": {"part": "mlp"}, "compile": False}
    config, exact = TrainerConfig(model=model), TrainerConfig(model=model | {"dtype": "float32"})
    torch._dynamo.reset()
    for seed in range(3):  # three packings of different lengths
        micro_batch = MicroBatch.pack(random_samples(4, seed=seed))
        compiled_loss, compiled_grads = step(config, world, micro_batch, backend="inductor")
        eager_loss, eager_grads = step(config, world, micro_batch)
        exact_loss, exact_grads = step(exact, world, micro_batch)
        assert abs(compiled_loss - exact_loss) <= 2 * abs(eager_loss - exact_loss) + 1e-4
        for name, grad in exact_grads.items():
            compiled_error = (compiled_grads[name] - grad).norm()
            assert compiled_error <= 2 * (eager_grads[name] - grad).norm() + 1e-3 * grad.norm(), name


def failing_forward_backend(graph, example_inputs):
    raise RuntimeError("this backend compiles nothing")


def failing_backward_compiler(graph, example_inputs):
    raise RuntimeError("this backend compiles no backward graph")


FAILING_BACKWARD = aot_autograd(fw_compiler=lambda graph, inputs: make_boxed_func(graph.forward),
                                bw_compiler=failing_backward_compiler)  # fmt: skip


def graph_break_in_the_last_mlp(model):
    """Make the last decoder layer's MLP break Dynamo's graph (eagerly: the same computation)."""
    mlp = decoder_layers(model)[-1].mlp
    forward = mlp.forward

    def breaking(hidden):
        torch._dynamo.graph_break()
        return forward(hidden)

    mlp.forward = breaking


@pytest.mark.parametrize(
    "backend, prepare",
    [(failing_forward_backend, lambda model: None), (FAILING_BACKWARD, lambda model: None),
     ("aot_eager", graph_break_in_the_last_mlp)],
    ids=["forward-compile-fails", "backward-compile-fails", "graph-break"],
)  # fmt: skip
def test_a_failed_compile_falls_back_to_the_eager_step_with_one_warning(
    world, random_samples, tiny_model_path, caplog, backend, prepare
):
    config = TrainerConfig(model={"name": tiny_model_path, "compile": False})
    micro_batch = MicroBatch.pack(random_samples(3))
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        model, optimizer, metrics = stepped_model(config, world, micro_batch, backend, prepare)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "model.compile = false" in warnings[0], warnings
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(model))  # eager from now on
    eager, eager_optimizer, eager_metrics = stepped_model(config, world, micro_batch)
    assert metrics == eager_metrics  # loss, gradient norm, ...: the eager step's, exactly
    for (name, parameter), eager_parameter in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad.full_tensor(), eager_parameter.grad.full_tensor(), msg=name)
        torch.testing.assert_close(parameter.full_tensor(), eager_parameter.full_tensor(), msg=name)  # one step
        assert optimizer.state[parameter]["step"] == eager_optimizer.state[eager_parameter]["step"] == 1


def test_compile_true_warns_where_it_compiles_each_packing_anew(caplog, monkeypatch):
    monkeypatch.setattr("trainer.attention.varlen_attn", lambda *args, **kwargs: None)  # as torch >= 2.10 has
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    cases = [(True, "auto", cpu), (True, "float32", gpu), (False, "auto", cpu), ("auto", "auto", cpu),
             (True, "bfloat16", gpu), (True, "auto", gpu)]  # fmt: skip
    warned = []
    for setting, dtype, device in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainer"):
            warn_on_compile_setting(TrainerModelConfig(name="tiny", compile=setting, dtype=dtype), device)
        warned.append([record.getMessage() for record in caplog.records])
    assert [len(lines) for lines in warned] == [1, 1, 0, 0, 0, 0]
    assert warned[0][0].startswith("model.compile = true on cpu in float32: attention runs once per sample")
    assert "on cuda in float32" in warned[1][0]
