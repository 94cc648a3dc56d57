"""The cross-entropy component (per-token weights in the batch, docs/losses.md): hand-computed on a batch of one
RL sample and one cross-entropy sample, whole and split into micro-batches, each component normalized over its own
tokens so that mixing them changes neither one's gradient."""

import dataclasses

import pytest
import torch
from test_zero_signal import full

from contracts.protocol import BatchInfo, MicroBatch, Sample
from trainer.config import TrainerConfig
from trainer.model import Scores, packed_logprobs
from trainer.optim import build_optimizer
from trainer.train import build_model, micro_batch_loss, train_step

# An RL sample (a prompt token, two sampled tokens, advantage +2, on policy) and a cross-entropy sample (a prompt
# token, two tokens of weights 1 and 0.5 that the policy did not sample). The trainer's logprobs of the six tokens:
LOGPROBS = [0.0, -0.5, -1.0, 0.0, -2.0, -3.0]
RL = Sample([5, 6, 7], [False, True, True], [0.0, -0.5, -1.0], 2.0, 1.0, 0)
CE = Sample([8, 9, 10], [False] * 3, [0.0] * 3, 0.0, 0.0, 0, ce_weights=[0.0, 1.0, 0.5])


def step_loss(samples: list[Sample], splits: list[list[int]]) -> tuple[float, list[float], dict]:
    """The loss and its gradient at each token of ``samples`` packed into micro-batches as ``splits`` says, and
    the last micro-batch's metrics."""
    rows = {id(RL): LOGPROBS[:3], id(CE): LOGPROBS[3:]}
    logprobs = torch.tensor([lp for s in samples for lp in rows[id(s)]], requires_grad=True)
    info = BatchInfo(1, len(samples), 3 * len(samples), sum(sum(s.loss_mask) for s in samples), 0.0, 1.0,
                     num_ce_tokens=sum(sum(w != 0 for w in s.ce_weights or []) for s in samples))  # fmt: skip
    config = TrainerConfig(model={"name": "unused"}, output_dir="unused")
    total, start = 0.0, 0
    for split in splits:
        micro_batch = MicroBatch.pack([samples[i] for i in split])
        n = len(micro_batch.input_ids)
        part = logprobs[start : start + n]
        scores = Scores(part, torch.zeros(n), torch.zeros(n, dtype=torch.bool), torch.zeros(n))
        loss, metrics = micro_batch_loss(scores, micro_batch, info, config, torch.device("cpu"))
        total, start = total + loss, start + n
    (grad,) = torch.autograd.grad(total, logprobs)
    return float(total.detach()), grad.tolist(), metrics


@pytest.mark.parametrize("splits", [[[0, 1]], [[0], [1]]], ids=["whole", "split"])
def test_an_rl_and_a_cross_entropy_sample_each_normalized_over_their_own_tokens(splits):
    # RL: -ratio * A per sampled token over its 2 tokens: -(2 + 2) / 2 = -2, gradient -A / 2 = -1 each.
    # CE: -(1 * -2 + 0.5 * -3) / 2 weighted tokens = 1.75, gradient -w / 2 = -0.5 and -0.25.
    loss, grad, _ = step_loss([RL, CE], splits)
    assert loss == pytest.approx(-2 + 1.75)
    assert grad == pytest.approx([0.0, -1.0, -1.0, 0.0, -0.5, -0.25])
    # each component alone gives its tokens the same gradient: mixing changes neither one's learning rate
    assert step_loss([RL], [[0]])[1] == pytest.approx(grad[:3])
    assert step_loss([CE], [[0]])[1] == pytest.approx(grad[3:])


def test_a_batch_without_cross_entropy_weights_has_no_such_tensor_nor_term():
    assert MicroBatch.pack([RL]).ce_weights is None
    loss, _, metrics = step_loss([RL], [[0]])
    assert loss == pytest.approx(-2.0) and "ce_loss" not in metrics
    _, _, metrics = step_loss([RL, CE], [[0, 1]])
    assert metrics["ce_loss"] == pytest.approx(1.75)


def test_a_step_of_cross_entropy_tokens_only_scores_them_through_the_model(tiny_model_path, world, random_samples):
    """A step whose samples have weights and no sampled token (a teacher's samples): the trainer scores the weighted
    tokens, its ce_loss is -mean(logprob) over them as the model's own forward gives, and the weights move."""
    samples = [dataclasses.replace(s, loss_mask=[False] * len(s.token_ids), inference_logprobs=[0.0] * len(s.token_ids),
                                   ce_weights=[float(m) for m in s.loss_mask]) for s in random_samples(2)]  # fmt: skip
    micro_batch = MicroBatch.pack(samples)
    info = BatchInfo(1, 2, len(micro_batch.input_ids), 0, 0.0, 1.0, num_ce_tokens=micro_batch.ce_tokens())
    config = TrainerConfig(model={"name": tiny_model_path}, output_dir="unused")
    model = build_model(config.model, world, config.optim.offload)
    optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
    with torch.no_grad():
        logprobs = packed_logprobs(model, micro_batch, 1.0)
    expected = float(-(logprobs * micro_batch.ce_weights).sum() / info.num_ce_tokens)
    before = [full(p) for p in model.parameters()]
    metrics = train_step(model, optimizer, [(micro_batch, 1.0)], info, config, world)
    assert metrics["ce_loss"] == pytest.approx(expected, rel=1e-4) and expected > 1.0
    assert metrics["loss"] == pytest.approx(expected, rel=1e-4)
    assert any(not torch.equal(b, full(p)) for b, p in zip(before, model.parameters(), strict=True))
