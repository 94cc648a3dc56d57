import math

import pytest
import torch

from trainer.config import LossConfig
from trainer.loss import policy_loss


def test_policy_loss_hand_computed():
    # token 0 is prompt; tokens 1-3 sampled. Ratios: e^0 = 1, e^0.1, and e^3 (outside [0.5, 2]: masked).
    logprobs = torch.tensor([-9.0, -1.0, -0.9, -0.5], requires_grad=True)
    inference = torch.tensor([0.0, -1.0, -1.0, -3.5])
    advantages = torch.tensor([5.0, 2.0, -1.0, 4.0])
    mask = torch.tensor([False, True, True, True])
    config = LossConfig(mask_low=0.5, mask_high=2.0)
    loss, metrics = policy_loss(logprobs, inference, advantages, mask, torch.tensor([4]), config, 4, 1)
    expected = -(1.0 * 2.0 + math.exp(0.1) * -1.0) / 4
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    loss.backward()
    # d/dlogp of -ratio * A / N = -ratio * A / N; prompt and masked tokens get no gradient
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, -2.0 / 4, math.exp(0.1) / 4, 0.0]))
    assert metrics["bounded_tokens"].item() == 1
    k3 = (math.exp(0.1) - 1 - 0.1) + (math.exp(3) - 1 - 3)
    assert math.isclose(metrics["mismatch_kl"].item(), k3, rel_tol=1e-5)


def test_policy_loss_on_policy_gradient_is_advantage_weighted():
    # At step 0 (ratio 1) the gradient is the plain -A * grad(logp) / N.
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    advantages, mask = torch.tensor([1.0, -3.0]), torch.tensor([True, True])
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask, torch.tensor([2]), LossConfig(), 2, 1)
    assert math.isclose(loss.item(), -(1.0 - 3.0) / 2, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.5, 1.5]))


def test_ppo_clip_higher_takes_the_pessimistic_term():
    # ratios e^0.5 = 1.65 (A > 0: clipped at 1.28, no gradient) and e^-0.5 = 0.61 (A > 0: unclipped, min is ratio)
    logprobs = torch.tensor([0.0, -0.5, -1.5], requires_grad=True)
    inference = torch.tensor([0.0, -1.0, -1.0])
    advantages = torch.tensor([0.0, 1.0, 1.0])
    mask = torch.tensor([False, True, True])
    config = LossConfig(bound="clip", clip_low=0.2, clip_high=0.28)
    loss, metrics = policy_loss(logprobs, inference, advantages, mask, torch.tensor([3]), config, 2, 1)
    assert math.isclose(loss.item(), -(1.28 + math.exp(-0.5)) / 2, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 0.0, -math.exp(-0.5) / 2]))
    assert metrics["bounded_tokens"].item() == 1


def test_sequence_ratio_and_sequence_normalization_gspo():
    # two samples: [prompt, a, b] with token log ratios 0.2, 0.4 (sequence: e^0.3), and [prompt, c] with -0.1
    logprobs = torch.tensor([0.0, -0.8, -0.6, 0.0, -1.1], requires_grad=True)
    inference = torch.tensor([0.0, -1.0, -1.0, 0.0, -1.0])
    advantages = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0])
    mask = torch.tensor([False, True, True, False, True])
    config = LossConfig(ratio="sequence", normalization="sequence")
    loss, _ = policy_loss(logprobs, inference, advantages, mask, torch.tensor([3, 2]), config, 3, 2)
    # per sample: mean over its tokens of -s_i * A_i; then mean over samples
    expected = (-math.exp(0.3) * 2.0 + math.exp(-0.1) * 1.0) / 2
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    loss.backward()
    # d/dlogp_t of -s A / 2 (sample mean of equal terms) = -s A / |y| / 2 for each of the sample's tokens
    want = [0.0, -math.exp(0.3) * 2 / 2 / 2, -math.exp(0.3) * 2 / 2 / 2, 0.0, math.exp(-0.1) / 2]
    torch.testing.assert_close(logprobs.grad, torch.tensor(want))


def test_constant_normalization_dr_grpo():
    logprobs = torch.tensor([0.0, -1.0, -1.0], requires_grad=True)
    mask = torch.tensor([False, True, True])
    config = LossConfig(normalization="constant", norm_length=10)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.ones(3), mask, torch.tensor([3]), config, 2, 1)
    assert math.isclose(loss.item(), -2 / (1 * 10), rel_tol=1e-6)


@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("bound", ["mask", "clip"])
@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_loss_and_gradients_do_not_depend_on_how_samples_are_split(ratio, bound, normalization):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7, 4]
    n = sum(lengths)
    logprobs = (-torch.rand(n, generator=generator) * 3).requires_grad_()
    inference = logprobs.detach() + torch.randn(n, generator=generator) * 0.3
    advantages = torch.repeat_interleave(torch.randn(len(lengths), generator=generator), torch.tensor(lengths))
    mask = torch.rand(n, generator=generator) > 0.3
    config = LossConfig(ratio=ratio, bound=bound, normalization=normalization, mask_low=0.8, mask_high=1.25)
    num_loss_tokens = int(mask.sum())

    def step_loss(splits: list[list[int]]):
        total, start = 0.0, 0
        for split in splits:
            size = sum(split)
            part = slice(start, start + size)
            loss, _ = policy_loss(
                logprobs[part], inference[part], advantages[part], mask[part], torch.tensor(split), config,
                num_loss_tokens, len(lengths),
            )  # fmt: skip
            total, start = total + loss, start + size
        (grad,) = torch.autograd.grad(total, logprobs)
        return total.detach(), grad

    whole_loss, whole_grad = step_loss([lengths])
    split_loss, split_grad = step_loss([lengths[:1], lengths[1:3], lengths[3:]])
    torch.testing.assert_close(split_loss, whole_loss)
    torch.testing.assert_close(split_grad, whole_grad)


def test_entropy_bonus_and_kl_penalty_hand_computed():
    # on-policy (ratio 1), so the policy term is -A per token; tokens 1 and 2 are sampled
    logprobs = torch.tensor([0.0, -1.0, -2.0], requires_grad=True)
    entropy = torch.tensor([9.0, 3.0, 2.0], requires_grad=True)
    reference = torch.tensor([0.0, -1.5, -1.0])
    advantages, mask = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([False, True, True])
    config = LossConfig(entropy_coef=0.1, kl_coef=0.5)
    loss, metrics = policy_loss(
        logprobs, logprobs.detach(), advantages, mask, torch.tensor([3]), config, 2, 1,
        entropy=entropy, reference_logprobs=reference,
    )  # fmt: skip
    d = reference - logprobs.detach()  # log(ref / policy) per token: -0.5 and 1.0
    k3 = d.exp() - d - 1
    expected = (-2.0 - 0.1 * (3.0 + 2.0) + 0.5 * (k3[1] + k3[2]).item()) / 2
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    loss.backward()
    # d/dlogp: (-A·ratio) + kl_coef · (1 - e^d); d/dentropy: -entropy_coef; all over N_tok = 2
    want_logprobs = torch.tensor([0.0, -1 + 0.5 * (1 - math.exp(-0.5)), -1 + 0.5 * (1 - math.exp(1.0))]) / 2
    torch.testing.assert_close(logprobs.grad, want_logprobs)
    torch.testing.assert_close(entropy.grad, torch.tensor([0.0, -0.05, -0.05]))
    assert math.isclose(metrics["entropy"].item(), 5.0)
    assert math.isclose(metrics["reference_kl"].item(), (k3[1] + k3[2]).item(), rel_tol=1e-6)


def test_no_entropy_or_kl_terms_by_default():
    logprobs = torch.tensor([0.0, -1.0], requires_grad=True)
    args = (logprobs, logprobs.detach(), torch.ones(2), torch.tensor([False, True]), torch.tensor([2]))
    plain, _ = policy_loss(*args, LossConfig(), 1, 1)
    with_inputs, metrics = policy_loss(*args, LossConfig(), 1, 1, entropy=torch.tensor([0.0, 5.0]))
    assert plain.item() == with_inputs.item() and metrics["entropy"].item() == 5.0
