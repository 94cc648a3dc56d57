import math

import torch

from trainer.loss import policy_loss, selective_log_softmax, shifted_logprobs


def test_selective_log_softmax_matches_naive():
    logits = torch.randn(5, 11)
    ids = torch.randint(0, 11, (5,))
    naive = torch.stack([torch.log_softmax(logits[i], -1)[ids[i]] for i in range(5)])
    torch.testing.assert_close(selective_log_softmax(logits, ids), naive)


def test_shifted_logprobs_apply_temperature_and_shift():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ids = torch.tensor([2, 1, 0])
    out = shifted_logprobs(logits, ids, temperature=0.5)
    assert out[0] == 0
    # token 1 is predicted by row 0 at T = 0.5: logits [0, 2, 4]
    assert math.isclose(out[1].item(), 2 - math.log(1 + math.exp(2) + math.exp(4)), rel_tol=1e-6)
    # token 0 is predicted by row 1 at T = 0.5: logits [4, 0, 0]
    assert math.isclose(out[2].item(), 4 - math.log(math.exp(4) + 2), abs_tol=1e-6)


def test_policy_loss_hand_computed():
    # token 0 is prompt; tokens 1-3 sampled. Ratios: e^0 = 1, e^0.1, and e^3 (outside [0.5, 2]: masked).
    logprobs = torch.tensor([-9.0, -1.0, -0.9, -0.5], requires_grad=True)
    inference = torch.tensor([0.0, -1.0, -1.0, -3.5])
    advantages = torch.tensor([5.0, 2.0, -1.0, 4.0])
    mask = torch.tensor([False, True, True, True])
    loss, metrics = policy_loss(logprobs, inference, advantages, mask, normalizer=4, mask_low=0.5, mask_high=2.0)
    expected = -(1.0 * 2.0 + math.exp(0.1) * -1.0) / 4
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    loss.backward()
    # d/dlogp of -ratio * A / N = -ratio * A / N; prompt and masked tokens get no gradient
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, -2.0 / 4, math.exp(0.1) / 4, 0.0]))
    assert metrics["masked_tokens"].item() == 1
    k3 = (math.exp(0.1) - 1 - 0.1) + (math.exp(3) - 1 - 3)
    assert math.isclose(metrics["mismatch_kl"].item(), k3, rel_tol=1e-5)


def test_policy_loss_on_policy_gradient_is_advantage_weighted():
    # At step 0 (ratio 1) the gradient is the plain -A * grad(logp) / N.
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, _ = policy_loss(
        logprobs, logprobs.detach(), torch.tensor([1.0, -3.0]), torch.tensor([True, True]), 2, 0.125, 8.0
    )
    assert math.isclose(loss.item(), -(1.0 - 3.0) / 2, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.5, 1.5]))
