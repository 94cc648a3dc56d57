"""A training step reads nothing back from the device until its end: no host synchronisation per micro-batch.

On a GPU the host waits for the device whenever it reads a value the device computed (``.item()``, ``.tolist()``,
``nonzero``, a tensor's truth value ...). On CPU nothing waits, so the CPU test tells what would: it follows
which tensors hold device values (the model's parameters and buffers, and what is computed from them) and counts
the host's reads of them during ``train_step``. That count must not grow with the number of
micro-batches. On GPU, CUDA's sync debug mode counts the real synchronisations the same way.
"""

import traceback
import warnings

import pytest
import torch
from batches import random_samples
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

import trainer.loss
import trainer.train
from contracts.protocol import BatchInfo, MicroBatch
from contracts.sampling import NO_TRUNCATION, Truncation
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer
from trainer.train import build_model, frozen_reference, train_step

# Operators that hand a tensor's values (or a size that depends on them) to the host.
READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "repeat_interleave", "masked_select", "unique"}


def caller() -> str:
    """The innermost frame in Trident's own code (or the innermost at all), as ``file:line``."""
    frames = traceback.extract_stack()[:-2]
    ours = [f for f in frames if "/src/" in f.filename and "site-packages" not in f.filename] or frames
    return f"{ours[-1].filename.split('/src/')[-1]}:{ours[-1].lineno}"


class DeviceReads(TorchDispatchMode):
    """Records the operators in :data:`READS` applied to device tensors: the model's parameters and buffers and
    whatever is computed from them (anything else, the micro-batches' tensors included, is the host's)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.device = WeakTensorKeyDictionary()
        for tensor in [*model.parameters(), *model.buffers()]:
            self.device[tensor.to_local() if isinstance(tensor, DTensor) else tensor] = True
        self.reads: list[str] = []

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor in self.device or (isinstance(tensor, DTensor) and tensor.to_local() in self.device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = any(self.on_device(t) for t in inputs)
        if device and func.overloadpacket.__name__ in READS:
            self.reads.append(f"{func.overloadpacket.__name__} at {caller()}")
        out = func(*args, **kwargs)
        written = [  # tensors an operator writes into (in place, out=) hold device values from then on
            value
            for argument, value in zip(func._schema.arguments, args, strict=False)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor)
        ] + [v for k, v in kwargs.items() if k == "out" and isinstance(v, torch.Tensor)]
        if device:
            for tensor in [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)] + written:
                self.device[tensor] = True
        return out


class ListReads(TorchFunctionMode):
    """``Tensor.tolist`` and ``Tensor.numpy`` read a CPU tensor without an operator: recorded here."""

    def __init__(self, dispatch: DeviceReads):
        super().__init__()
        self.dispatch = dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and self.dispatch.on_device(args[0]):
            self.dispatch.reads.append(f"{func.__name__} at {caller()}")
        return func(*args, **(kwargs or {}))


def micro_batches(count: int) -> list[MicroBatch]:
    samples = random_samples(3 * count)
    return [MicroBatch.pack(samples[3 * i : 3 * i + 3]) for i in range(count)]


def step_reads(model, config, world, count: int, reference=None, truncation=NO_TRUNCATION) -> list[str]:
    """The host's reads of device values in one ``train_step`` over ``count`` micro-batches sampled under
    ``truncation``."""
    batches = micro_batches(count)
    loss_tokens = sum(int(b.loss_mask.sum()) for b in batches)
    info = BatchInfo(0, 3 * count, sum(len(b.input_ids) for b in batches), loss_tokens, 0.0, 1.0, truncation)
    optimizer, _ = build_optimizer(model, config.optim, 2)
    with DeviceReads(model) as reads, ListReads(reads):
        train_step(model, optimizer, [(b, 1.0) for b in batches], info, config, world, reference)
    return reads.reads


@pytest.mark.parametrize(
    "loss, truncation",
    [
        ({}, NO_TRUNCATION),
        ({"entropy_coef": 0.01, "kl_coef": 0.1, "correction": "sequence_truncate"}, Truncation(0.9, 20, 0.05)),
    ],
)
def test_a_step_reads_device_values_only_at_its_end(tmp_path, tiny_model_path, world, loss, truncation):
    config = TrainerConfig(output_dir=tmp_path, model={"name": tiny_model_path}, loss=loss)
    model = build_model(config.model, world, offload=False)
    reference = frozen_reference(model, config, world)
    two = step_reads(model, config, world, 2, reference, truncation)
    five = step_reads(model, config, world, 5, reference, truncation)
    assert two == five, f"reads per micro-batch: {two} with 2 micro-batches, {five} with 5"
    assert len(five) <= 2, five  # the gradient norm, the metrics


def test_the_count_sees_a_read_of_the_loss(tmp_path, tiny_model_path, world, monkeypatch):
    """The proxy would catch ``loss.item()`` back in the loop over micro-batches."""
    config = TrainerConfig(output_dir=tmp_path, model={"name": tiny_model_path})
    model = build_model(config.model, world, offload=False)

    def reading_loss(*args, **kwargs):
        loss, metrics = trainer.loss.policy_loss(*args, **kwargs)
        loss.item()
        return loss, metrics

    monkeypatch.setattr(trainer.train, "policy_loss", reading_loss)
    assert len(step_reads(model, config, world, 3)) == len(step_reads(model, config, world, 2)) + 1


@pytest.mark.gpu
def test_a_gpu_step_synchronises_only_at_its_end(tmp_path, tiny_model_path, world):
    """CUDA's own count: warnings from ``set_sync_debug_mode`` do not grow with the micro-batches (2 against 5)."""
    config = TrainerConfig(output_dir=tmp_path, model={"name": tiny_model_path})
    model = build_model(config.model, world, offload=False)

    def synchronisations(count: int) -> int:
        batches = micro_batches(count)
        info = BatchInfo(0, 3 * count, 0, sum(int(b.loss_mask.sum()) for b in batches), 0.0, 1.0)
        optimizer, _ = build_optimizer(model, config.optim, 2)
        train_step(model, optimizer, [(b, 1.0) for b in batches], info, config, world)  # warm-up: compilation
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(model, optimizer, [(b, 1.0) for b in batches], info, config, world)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    two, five = synchronisations(2), synchronisations(5)
    # the caching allocator may sync once more or less from step to step (on an H200: 5 with 2, 4 with 5); one
    # sync per micro-batch would add at least 3
    assert five - two < 3, f"synchronisations: {two} with 2 micro-batches, {five} with 5"
