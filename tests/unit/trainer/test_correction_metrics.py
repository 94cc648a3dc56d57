"""A training step logs the shares of tokens and of samples whose off-policy correction weight was masked."""

import pytest
from conftest import random_samples

from rl.protocol import BatchInfo, MicroBatch
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer
from trainer.parallel import close_world, init_world
from trainer.train import build_model, train_step


@pytest.fixture
def world():
    world = init_world()
    yield world
    close_world()


def test_step_logs_the_shares_of_masked_tokens_and_samples(tmp_path, tiny_model_path, world):
    samples = random_samples(6)  # server logprobs near the tiny model's: geometric mean weights near 1
    stale = samples[4]  # the server gave its sampled tokens e^-12 of the trainer's probability
    stale.inference_logprobs = [lp - 12.0 * m for lp, m in zip(stale.inference_logprobs, stale.loss_mask, strict=True)]
    batches = [MicroBatch.pack(samples[:3]), MicroBatch.pack(samples[3:])]
    loss_tokens = [sum(s.loss_mask) for s in samples]
    info = BatchInfo(0, len(samples), sum(len(s.token_ids) for s in samples), sum(loss_tokens), 0.0, 1.0)
    loss = {"correction": "geometric_mask", "correction_low": 0.5, "correction_high": 2.0}
    config = TrainerConfig(output_dir=tmp_path, model={"name": tiny_model_path}, loss=loss)
    model = build_model(config.model, world, offload=False)
    optimizer, _ = build_optimizer(model, config.optim, 1)
    metrics = train_step(model, optimizer, [(b, 1.0) for b in batches], info, config, world)
    # sample 4's weight is about e^12: all its loss tokens are masked, and no other sample's
    assert metrics["corrected_fraction"] == pytest.approx(loss_tokens[4] / sum(loss_tokens))
    assert metrics["corrected_sample_fraction"] == pytest.approx(1 / 6)
    assert metrics["bounded_fraction"] == pytest.approx(loss_tokens[4] / sum(loss_tokens))  # IcePop drops them too
