"""micro_batch_tokens: the trainer packs a step's samples into micro-batches of that many tokens, apart from
seq_len; the step's loss and gradients do not depend on how the samples are grouped."""

import json

import pytest
import torch

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.protocol import BatchInfo, MicroBatch, pack_samples, repack
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer
from trainer.train import build_model, micro_batches_to_train, train, train_step


def step(micro_batches, info, config, world):
    """One train_step of the policy as loaded: its metrics and the gradients it computed."""
    model = build_model(config.model, world, offload=False)
    optimizer, _ = build_optimizer(model, config.optim, 10)
    metrics = train_step(model, optimizer, [(m, 1.0) for m in micro_batches], info, config, world)
    return metrics, {name: p.grad.full_tensor() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "loss",
    [{}, {"normalization": "sequence", "ratio": "sequence", "bound": "clip", "entropy_coef": 0.01},
     {"normalization": "constant", "norm_length": 64}],
    ids=["token", "sequence-gspo-clip-entropy", "constant"],
)  # fmt: skip
def test_the_step_is_the_same_however_its_samples_are_grouped(world, random_samples, tiny_model_path, loss):
    samples = random_samples(12)
    by_seq_len = [MicroBatch.pack(b) for b in pack_samples(samples, 64)]
    by_budget = repack(by_seq_len, 256)
    assert len(by_budget) < len(by_seq_len)  # fewer, larger micro-batches
    num_tokens, num_loss_tokens = sum(len(s.token_ids) for s in samples), sum(sum(s.loss_mask) for s in samples)
    info = BatchInfo(0, len(samples), num_tokens, num_loss_tokens, 0.0, 1.0)
    config = TrainerConfig(model={"name": tiny_model_path}, seq_len=64, micro_batch_tokens=256, loss=loss)
    (old, old_grads), (new, new_grads) = (step(m, info, config, world) for m in (by_seq_len, by_budget))
    assert new["loss"] == pytest.approx(old["loss"], abs=1e-3, rel=1e-3)
    assert new["grad_norm"] == pytest.approx(old["grad_norm"], rel=1e-3)
    for name, grad in old_grads.items():
        torch.testing.assert_close(new_grads[name], grad, atol=1e-5, rtol=1e-3)


def test_a_budget_below_seq_len_is_refused_naming_both(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text("seq_len = 2048\nmicro_batch_tokens = 1024\n")
    with pytest.raises(ConfigError, match="micro_batch_tokens = 1024 is smaller than seq_len = 2048"):
        parse_config(TrainerConfig, ["@", str(path)])
    assert TrainerConfig(seq_len=2048).micro_batch_budget == 2048  # absent: seq_len, as before
    assert TrainerConfig(seq_len=2048, micro_batch_tokens=8192).micro_batch_budget == 8192


def test_without_a_budget_seq_len_bounds_the_orchestrators_micro_batches(random_samples):
    packed = [MicroBatch.pack(b) for b in pack_samples(random_samples(12), 128)]
    longest = max(len(m.input_ids) for m in packed)
    assert micro_batches_to_train(packed, TrainerConfig(seq_len=128), 3) is packed  # as packed: within seq_len
    message = (
        f"^step 3: the orchestrator packed a micro-batch of {longest} tokens, more than the trainer's seq_len = 64"
    )
    with pytest.raises(TridentError, match=message):
        micro_batches_to_train(packed, TrainerConfig(seq_len=64), 3)
    repacked = micro_batches_to_train(packed, TrainerConfig(seq_len=64, micro_batch_tokens=256), 3)
    assert max(len(m.input_ids) for m in repacked) <= 256


def test_a_run_with_a_budget_trains_as_one_without(tmp_path, write_batches, tiny_model_path):
    losses = {}
    for budget in (None, 4096):  # the batch's ten samples, packed by the orchestrator into 128-token micro-batches
        output_dir = tmp_path / str(budget)
        write_batches(output_dir, steps=1, seq_len=128)
        train(TrainerConfig(output_dir=output_dir, model={"name": tiny_model_path}, max_steps=1,
                            micro_batch_tokens=budget))  # fmt: skip
        record = json.loads((output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()[0])
        losses[budget] = record["loss"]
    assert losses[4096] == pytest.approx(losses[None], rel=1e-3, abs=1e-4)
