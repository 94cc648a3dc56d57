"""The cross-entropy component (per-token weights in the batch, docs/losses.md): hand-computed on a batch of one
RL sample and one cross-entropy sample, whole and split into micro-batches, each component normalized over its own
tokens so that mixing them changes neither one's gradient."""

import pytest
import torch

from contracts.protocol import BatchInfo, MicroBatch, Sample
from trainer.config import TrainerConfig
from trainer.model import Scores
from trainer.train import micro_batch_loss

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
