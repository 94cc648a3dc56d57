import math
from typing import get_args

import pytest
import torch

from trainer.config import LossConfig, OffPolicyCorrection
from trainer.loss import correction_weights, policy_loss


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


def test_ppo_clip_lower_end_takes_the_pessimistic_term_of_a_negative_advantage():
    # A = -2: ratio e^-0.5 = 0.61 is clipped up to 1 - 0.2 (no gradient); e^0.5 = 1.65 and 1 stay (the min is theirs)
    logprobs = torch.tensor([0.0, -1.5, -0.5, -1.0], requires_grad=True)
    inference = torch.tensor([0.0, -1.0, -1.0, -1.0])
    advantages = torch.tensor([0.0, -2.0, -2.0, -2.0])
    mask = torch.tensor([False, True, True, True])
    config = LossConfig(bound="clip", clip_low=0.2, clip_high=0.28)
    loss, metrics = policy_loss(logprobs, inference, advantages, mask, torch.tensor([4]), config, 3, 1)
    assert math.isclose(loss.item(), (0.8 * 2 + math.exp(0.5) * 2 + 2) / 3, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 0.0, math.exp(0.5) * 2 / 3, 2 / 3]))
    assert metrics["bounded_tokens"].item() == 1  # the clipped one only, not the one at ratio 1


def test_mask_range_is_closed():
    # on policy every ratio is exactly 1: a range [1, 1] keeps them all
    logprobs = torch.tensor([0.0, -1.0, -2.0])
    config = LossConfig(bound="mask", mask_low=1.0, mask_high=1.0)
    mask = torch.tensor([False, True, True])
    advantages = torch.tensor([0.0, 1.0, 3.0])
    loss, metrics = policy_loss(logprobs, logprobs, advantages, mask, torch.tensor([3]), config, 2, 1)
    assert metrics["bounded_tokens"].item() == 0
    assert math.isclose(loss.item(), -(1.0 + 3.0) / 2, rel_tol=1e-6)


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


def split_losses(config: LossConfig, splits: list[list[list[int]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's loss and its gradient on one random batch of samples of lengths 5, 3, 7 and 4, computed with
    the samples split into micro-batches in each of the ways ``splits`` gives."""
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7, 4]
    n = sum(lengths)
    logprobs = (-torch.rand(n, generator=generator) * 3).requires_grad_()
    inference = logprobs.detach() + torch.randn(n, generator=generator) * 0.3
    advantages = torch.repeat_interleave(torch.randn(len(lengths), generator=generator), torch.tensor(lengths))
    mask = torch.rand(n, generator=generator) > 0.3
    num_loss_tokens = int(mask.sum())
    results = []
    for split in splits:
        assert sum(split, []) == lengths
        total, start = 0.0, 0
        for part_lengths in split:
            part = slice(start, start + sum(part_lengths))
            loss, _ = policy_loss(
                logprobs[part], inference[part], advantages[part], mask[part], torch.tensor(part_lengths), config,
                num_loss_tokens, len(lengths),
            )  # fmt: skip
            total, start = total + loss, part.stop
        (grad,) = torch.autograd.grad(total, logprobs)
        results.append((total.detach(), grad))
    return results


WHOLE_AND_SPLIT = [[[5, 3, 7, 4]], [[5], [3, 7], [4]]]


@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("bound", ["mask", "clip"])
@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_loss_and_gradients_do_not_depend_on_how_samples_are_split(ratio, bound, normalization):
    config = LossConfig(ratio=ratio, bound=bound, normalization=normalization, mask_low=0.8, mask_high=1.25)
    (whole_loss, whole_grad), (split_loss, split_grad) = split_losses(config, WHOLE_AND_SPLIT)
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


# Off-policy corrections. Token 0 of each sample is prompt, with a trainer/server log ratio that would be truncated
# or masked were it counted; the rest are loss tokens.
TOKENS = {  # one sample: loss-token log ratios 0.1, 1.0 (w = e: above 2), -1.0 and 3.0 (w = e^3: above IcePop's 8)
    "logprobs": [-9.0, -0.9, 0.0, -2.0, 2.0],
    "inference": [0.0, -1.0, -1.0, -1.0, -1.0],
    "advantages": [9.0, 2.0, 1.0, -1.0, 4.0],
    "mask": [False, True, True, True, True],
    "lengths": [5],
}
SAMPLES = {  # two samples: log ratios 0.4, 0.5 (product e^0.9 = 2.46, geometric mean e^0.45) and 0.3, -0.2
    "logprobs": [-9.0, -0.6, -0.5, 5.0, -0.7, -1.2],
    "inference": [0.0, -1.0, -1.0, 0.0, -1.0, -1.0],
    "advantages": [7.0, 1.0, 1.0, 7.0, -2.0, -2.0],
    "mask": [False, True, True, False, True, True],
    "lengths": [3, 3],
}


def corrected_loss(batch: dict, **config) -> tuple[float, list[float], dict[str, float]]:
    """The loss, its gradient at each token and the metrics of ``batch`` under ``LossConfig(**config)``."""
    logprobs = torch.tensor(batch["logprobs"], requires_grad=True)
    lengths, mask = torch.tensor(batch["lengths"]), torch.tensor(batch["mask"])
    num_loss_tokens, num_samples = int(mask.sum()), len(batch["lengths"])
    loss, metrics = policy_loss(
        logprobs, torch.tensor(batch["inference"]), torch.tensor(batch["advantages"]), mask, lengths,
        LossConfig(**config), num_loss_tokens, num_samples,
    )  # fmt: skip
    loss.backward()
    return loss.item(), logprobs.grad.tolist(), {name: value.item() for name, value in metrics.items()}


def test_default_loss_has_no_correction_and_weighs_by_the_ratio():
    # the token at log ratio 1.0 keeps its weight e (a correction would truncate it to 2); e^3 > 8 is masked
    loss, grad, metrics = corrected_loss(TOKENS)
    e = math.e
    assert LossConfig().correction == "none"
    assert math.isclose(loss, -(math.exp(0.1) * 2 + e * 1 + math.exp(-1) * -1) / 4, rel_tol=1e-6)
    assert grad == pytest.approx([0.0, -math.exp(0.1) * 2 / 4, -e / 4, math.exp(-1) / 4, 0.0], rel=1e-6)
    assert metrics.keys() == {"bounded_tokens", "mismatch_kl"} and metrics["bounded_tokens"] == 1


def test_token_truncated_importance_sampling():
    # weights e^0.1, min(e, 2) = 2, e^-1; the e^3 token is dropped by IcePop's mask (bound = "mask", [0.125, 8])
    loss, grad, metrics = corrected_loss(TOKENS, correction="token_truncate", correction_high=2.0)
    assert math.isclose(loss, -(math.exp(0.1) * 2 + 2 * 1 + math.exp(-1) * -1) / 4, rel_tol=1e-6)
    # the truncated token keeps a gradient, 2 · A (PPO's clipping would give it none)
    assert grad == pytest.approx([0.0, -math.exp(0.1) * 2 / 4, -2 / 4, math.exp(-1) / 4, 0.0], rel=1e-6)
    assert metrics["corrected_tokens"] == 2 and metrics["corrected_samples"] == 1  # the e and e^3 tokens
    assert metrics["bounded_tokens"] == 1
    _, _, metrics = corrected_loss(TOKENS, correction="token_truncate", correction_high=5.0)
    assert metrics["corrected_tokens"] == 1 and metrics["corrected_samples"] == 1  # one token corrects its sample


def test_token_masked_importance_sampling():
    # [0.5, 2] keeps e^0.1 only: e is above, e^-1 = 0.37 below, e^3 above
    loss, grad, metrics = corrected_loss(TOKENS, correction="token_mask", correction_low=0.5, correction_high=2.0)
    assert math.isclose(loss, -(math.exp(0.1) * 2) / 4, rel_tol=1e-6)  # masked tokens still count in N_tok = 4
    assert grad == pytest.approx([0.0, -math.exp(0.1) * 2 / 4, 0.0, 0.0, 0.0], rel=1e-6)
    assert metrics["corrected_tokens"] == 3 and metrics["corrected_samples"] == 1


def test_correction_range_is_closed_and_truncates_from_below_too():
    # weights exactly 0.5 and 2 lie inside [0.5, 2] and stay as they are; 0.25 lies below: truncated up to 0.5 or masked
    log_ratio = torch.tensor([math.log(0.5), math.log(2.0), math.log(0.25)])
    segment, tokens_per_sample = torch.zeros(3, dtype=torch.long), torch.tensor([3.0])
    for action, below in (("truncate", 0.5), ("mask", 0.0)):
        config = LossConfig(correction=f"token_{action}", correction_low=0.5, correction_high=2.0)
        weights, outside = correction_weights(log_ratio, segment, tokens_per_sample, config)
        assert outside.tolist() == [False, False, True]
        assert weights.tolist() == pytest.approx([0.5, 2.0, below], rel=1e-6)


def test_sequence_truncated_importance_sampling_uses_the_product():
    # sample 1: e^0.4 · e^0.5 = 2.46, truncated to 2 (no token alone is above 2); sample 2: e^0.3 · e^-0.2 = e^0.1
    loss, grad, metrics = corrected_loss(SAMPLES, correction="sequence_truncate", correction_high=2.0)
    assert math.isclose(loss, -(2 * 1 * 2 + math.exp(0.1) * -2 * 2) / 4, rel_tol=1e-6)
    assert grad == pytest.approx([0.0, -2 / 4, -2 / 4, 0.0, math.exp(0.1) * 2 / 4, math.exp(0.1) * 2 / 4], rel=1e-6)
    assert metrics["corrected_tokens"] == 2 and metrics["corrected_samples"] == 1
    _, _, per_token = corrected_loss(SAMPLES, correction="token_truncate", correction_high=2.0)
    assert per_token["corrected_tokens"] == 0


def test_sequence_masked_importance_sampling_drops_whole_samples():
    # sample 1's product 2.46 leaves [0.5, 2]: none of its tokens gets a loss; sample 2 keeps weight e^0.1
    loss, grad, metrics = corrected_loss(SAMPLES, correction="sequence_mask", correction_low=0.5, correction_high=2.0)
    assert math.isclose(loss, -(math.exp(0.1) * -2 * 2) / 4, rel_tol=1e-6)
    assert grad == pytest.approx([0.0, 0.0, 0.0, 0.0, math.exp(0.1) * 2 / 4, math.exp(0.1) * 2 / 4], rel=1e-6)
    assert metrics["corrected_tokens"] == 2 and metrics["corrected_samples"] == 1


def test_geometric_mask_keeps_what_the_product_drops():
    # geometric means e^0.45 = 1.57 and e^0.05: both inside [0.5, 2]
    loss, grad, metrics = corrected_loss(SAMPLES, correction="geometric_mask", correction_low=0.5, correction_high=2.0)
    w1, w2 = math.exp(0.45), math.exp(0.05)
    assert math.isclose(loss, -(w1 * 1 * 2 + w2 * -2 * 2) / 4, rel_tol=1e-6)
    assert grad == pytest.approx([0.0, -w1 / 4, -w1 / 4, 0.0, w2 * 2 / 4, w2 * 2 / 4], rel=1e-6)
    assert metrics["corrected_tokens"] == 0 and metrics["corrected_samples"] == 0


def test_geometric_truncation_with_sequence_normalization():
    # e^0.45 = 1.57 truncated to 1.5; each sample's token mean, then the mean over the 2 samples
    config = {"correction": "geometric_truncate", "correction_high": 1.5, "normalization": "sequence"}
    loss, grad, metrics = corrected_loss(SAMPLES, **config)
    w2 = math.exp(0.05)
    assert math.isclose(loss, (-1.5 * 1 + -w2 * -2) / 2, rel_tol=1e-6)
    assert grad == pytest.approx([0.0, -1.5 / 2 / 2, -1.5 / 2 / 2, 0.0, w2 * 2 / 2 / 2, w2 * 2 / 2 / 2], rel=1e-6)
    assert metrics["corrected_tokens"] == 2 and metrics["corrected_samples"] == 1


@pytest.mark.parametrize(
    ("correction", "same_as"),
    [("token_mask", {"ratio": "token"}), ("geometric_mask", {"ratio": "sequence"})],
)
@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_masked_corrections_equal_icepop_on_the_same_ratio(correction, same_as, normalization):
    # masking by a fixed weight gives the loss and gradient of IcePop's mask on the ratio itself (GSPO's per sample)
    bounds = {"correction_low": 0.9, "correction_high": 1.1, "mask_low": 0.0, "mask_high": math.inf}
    corrected = LossConfig(correction=correction, normalization=normalization, **bounds)
    icepop = LossConfig(mask_low=0.9, mask_high=1.1, normalization=normalization, **same_as)
    ((corrected_loss_, corrected_grad),) = split_losses(corrected, WHOLE_AND_SPLIT[:1])
    ((icepop_loss, icepop_grad),) = split_losses(icepop, WHOLE_AND_SPLIT[:1])
    torch.testing.assert_close(corrected_loss_, icepop_loss)
    torch.testing.assert_close(corrected_grad, icepop_grad)
    unbounded = LossConfig(mask_low=0.0, mask_high=math.inf, normalization=normalization, **same_as)
    ((_, unbounded_grad),) = split_losses(unbounded, WHOLE_AND_SPLIT[:1])
    assert icepop_grad.count_nonzero() < unbounded_grad.count_nonzero()  # the bounds masked some loss tokens


@pytest.mark.parametrize("correction", [c for c in get_args(OffPolicyCorrection) if c != "none"])
@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_corrections_do_not_depend_on_how_samples_are_split(correction, normalization):
    config = LossConfig(correction=correction, normalization=normalization, correction_low=0.8, correction_high=1.25)
    (whole_loss, whole_grad), (split_loss, split_grad) = split_losses(config, WHOLE_AND_SPLIT)
    torch.testing.assert_close(split_loss, whole_loss)
    torch.testing.assert_close(split_grad, whole_grad)


def test_staleness_bounds_each_token_by_the_weights_that_sampled_it():
    """One sample whose weights changed in flight: its first two sampled tokens came from weights 2 steps stale,
    the last two from fresh ones. max_token_staleness = 1 drops the stale two only; each kept token's ratio is
    against the logprob of the weights that sampled it, so a fresh token on policy has ratio 1 whatever the stale
    ones' ratios are."""
    logprobs = torch.tensor([0.0, -1.0, -1.0, -0.5, -2.0], requires_grad=True)
    inference = torch.tensor([0.0, -1.5, -0.5, -0.5, -2.0])  # the stale tokens' sampler differs from the trainer
    advantages = torch.full((5,), 1.0)
    mask = torch.tensor([False, True, True, True, True])
    staleness = torch.tensor([2, 2, 2, 0, 0])  # the prompt token's is not counted
    bounded = LossConfig(max_token_staleness=1)
    loss, metrics = policy_loss(logprobs, inference, advantages, mask, torch.tensor([5]), bounded, 4, 1,
                                staleness=staleness)  # fmt: skip
    assert math.isclose(loss.item(), -(1.0 + 1.0) / 4, rel_tol=1e-6)  # two fresh tokens, on policy: ratio 1
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.25]))
    assert (metrics["too_stale_tokens"].item(), metrics["stale_tokens"].item()) == (2, 2)
    assert metrics["token_staleness"].item() == 4  # summed over the loss tokens: the trainer logs the mean
    unbounded, _ = policy_loss(logprobs, inference, advantages, mask, torch.tensor([5]), LossConfig(), 4, 1,
                               staleness=staleness)  # fmt: skip
    expected = -(math.exp(0.5) + math.exp(-0.5) + 1.0 + 1.0) / 4  # without the bound the stale tokens count too
    assert math.isclose(unbounded.item(), expected, rel_tol=1e-6)


def test_a_token_exactly_max_token_staleness_old_is_kept_and_counted_stale():
    logprobs = torch.zeros(5)
    staleness = torch.tensor([0, 1, 1, 2, 0])  # one step stale: within max_token_staleness = 1, but stale
    config = LossConfig(max_token_staleness=1)
    mask = torch.ones(5, dtype=torch.bool)
    _, metrics = policy_loss(logprobs, logprobs, torch.ones(5), mask, torch.tensor([5]), config, 5, 1,
                             staleness=staleness)  # fmt: skip
    assert (metrics["too_stale_tokens"].item(), metrics["stale_tokens"].item()) == (1, 3)
    assert metrics["token_staleness"].item() == 4
    assert metrics["bounded_tokens"].item() == 0 and metrics["mismatch_kl"].item() == 0  # the other metrics stay


def test_entropy_metric_sums_over_the_entropy_mask_or_the_loss_tokens():
    entropy = torch.tensor([5.0, 1.0, 2.0, 4.0])
    logprobs = torch.zeros(4)
    args = (logprobs, logprobs, torch.zeros(4), torch.tensor([False, True, True, False]), torch.tensor([4]))
    _, metrics = policy_loss(*args, LossConfig(), 2, 1, entropy=entropy)
    assert (metrics["entropy"].item(), metrics["entropy_tokens"].item()) == (3.0, 2)
    _, metrics = policy_loss(*args, LossConfig(), 2, 1, entropy=entropy, entropy_mask=torch.tensor([1, 1, 0, 0]) > 0)
    assert (metrics["entropy"].item(), metrics["entropy_tokens"].item()) == (6.0, 2)
