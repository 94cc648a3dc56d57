"""The 2026 policy terms (bound = "cispo", "sapo", "dppo") and a custom one, each against its published formula
computed by hand on the same two samples; docs/losses.md has the formulas."""

import math

import pytest
import torch
from test_loss import WHOLE_AND_SPLIT, corrected_loss, split_losses

from trainer.config import LossConfig

# Two samples of a prompt token and two loss tokens, advantages +2 and -1. Per loss token (a, b | c, d):
# log ratio 0.6, 1.0 | -0.7, 2.0; probability change (trainer's minus server's) +0.408, +0.031 | -0.305, +0.525.
BATCH = {
    "logprobs": [-9.0, -0.1, -3.0, 5.0, -1.2, -0.5],
    "inference": [0.0, -0.7, -4.0, 0.0, -0.5, -2.5],
    "advantages": [2.0, 2.0, 2.0, -1.0, -1.0, -1.0],
    "mask": [False, True, True, False, True, True],
    "lengths": [3, 3],
}
LOSS_TOKENS = [1, 2, 4, 5]


def per_loss_token(values: list[float]) -> list[float]:
    """``values`` (one per loss token) placed at the batch's positions, 0 at its prompt tokens."""
    placed = [0.0] * len(BATCH["mask"])
    for position, value in zip(LOSS_TOKENS, values, strict=True):
        placed[position] = value
    return placed


def loss_token_values() -> tuple[list[float], list[float], list[float]]:
    """Each loss token's trainer logprob, ratio and advantage."""
    logprobs = [BATCH["logprobs"][t] for t in LOSS_TOKENS]
    ratios = [math.exp(BATCH["logprobs"][t] - BATCH["inference"][t]) for t in LOSS_TOKENS]
    return logprobs, ratios, [BATCH["advantages"][t] for t in LOSS_TOKENS]


def test_cispo_weighs_every_token_by_its_clipped_ratio_held_fixed():
    # loss -sg(clip(r, 0, 5)) · A · logp; gradient -clip(r) · A: token d's ratio e^2 = 7.4 is clipped to 5 and keeps it
    logprobs, ratios, advantages = loss_token_values()
    weights = [min(r, 5.0) for r in ratios]
    loss, grad, metrics = corrected_loss(BATCH, bound="cispo")
    expected = -sum(w * a * lp for w, a, lp in zip(weights, advantages, logprobs, strict=True)) / 4
    assert math.isclose(loss, expected, rel_tol=1e-6)
    assert grad == pytest.approx(per_loss_token([-w * a / 4 for w, a in zip(weights, advantages, strict=True)]))
    assert metrics["bounded_tokens"] == 1
    # a lower end: token c's ratio e^-0.7 = 0.50 is raised to 0.55, and counted
    _, grad, metrics = corrected_loss(BATCH, bound="cispo", cispo_low=0.55)
    assert grad[4] == pytest.approx(0.55 / 4) and metrics["bounded_tokens"] == 2


def test_cispo_has_the_gradient_of_token_truncated_importance_sampling():
    # the same fixed, clamped weight on grad(logp): only the loss's value differs (CISPO's carries logp)
    bounds = {"cispo_low": 0.8, "cispo_high": 1.25}
    cispo = LossConfig(bound="cispo", **bounds)
    truncated = LossConfig(
        correction="token_truncate", correction_low=0.8, correction_high=1.25, mask_low=0.0, mask_high=math.inf
    )
    ((_, cispo_grad),) = split_losses(cispo, WHOLE_AND_SPLIT[:1])
    ((_, truncated_grad),) = split_losses(truncated, WHOLE_AND_SPLIT[:1])
    torch.testing.assert_close(cispo_grad, truncated_grad)


def sapo_gate(ratio: float, temperature: float) -> tuple[float, float]:
    """SAPO's gate sigmoid(τ (r - 1)) · 4 / τ, and its derivative in log r: 4 σ (1 - σ) r."""
    sigmoid = 1 / (1 + math.exp(-temperature * (ratio - 1)))
    return sigmoid * 4 / temperature, 4 * sigmoid * (1 - sigmoid) * ratio


def test_sapo_gates_the_ratio_softly_with_a_temperature_per_advantage_sign():
    # τ = 1.0 at the positive advantages (a, b), 1.05 at the negative ones (c, d); loss -f(r) · A
    _, ratios, advantages = loss_token_values()
    gates = [sapo_gate(r, 1.0 if a > 0 else 1.05) for r, a in zip(ratios, advantages, strict=True)]
    loss, grad, metrics = corrected_loss(BATCH, bound="sapo")
    assert math.isclose(loss, -sum(f * a for (f, _), a in zip(gates, advantages, strict=True)) / 4, rel_tol=1e-6)
    want = per_loss_token([-d * a / 4 for (_, d), a in zip(gates, advantages, strict=True)])
    assert grad == pytest.approx(want, abs=1e-6)  # token d's 1 - σ at τ (r - 1) = 6.7 keeps ~5 digits in float32
    assert "bounded_tokens" not in metrics  # a soft gate masks and clips nothing
    # on policy the gate is 1 with the plain gradient -A, whatever the temperature
    assert sapo_gate(1.0, 1.05) == pytest.approx((4 / 1.05 / 2, 1.0))


def test_dppo_masks_by_the_probability_change_and_adds_the_squared_log_ratio():
    # masked: a (A > 0, probability up 0.408 > 0.2) and c (A < 0, down 0.305 > 0.2). Kept: b, whose ratio e is far
    # from 1 but whose probability rose by 0.031 only, and d, whose probability rose at a negative advantage.
    _, ratios, advantages = loss_token_values()
    keep = [0.0, 1.0, 0.0, 1.0]
    log_ratios = [math.log(r) for r in ratios]
    loss, grad, metrics = corrected_loss(BATCH, bound="dppo")
    policy = -sum(r * a * k for r, a, k in zip(ratios, advantages, keep, strict=True))
    assert math.isclose(loss, (policy + 1e-3 * sum(x * x for x in log_ratios)) / 4, rel_tol=1e-6)
    # gradient in logp: -r · A where kept, plus 2 · 1e-3 · log r at every loss token
    want = [-r * a * k + 2e-3 * x for r, a, k, x in zip(ratios, advantages, keep, log_ratios, strict=True)]
    assert grad == pytest.approx(per_loss_token([w / 4 for w in want]), rel=1e-6)
    assert metrics["bounded_tokens"] == 2


@pytest.mark.parametrize("bound", ["cispo", "sapo", "dppo"])
@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_new_bounds_do_not_depend_on_how_samples_are_split(bound, ratio, normalization):
    if bound == "dppo" and ratio == "sequence":
        pytest.skip("refused: dppo masks by each token's own probability")
    config = LossConfig(bound=bound, ratio=ratio, normalization=normalization, cispo_low=0.8, cispo_high=1.25)
    (whole_loss, whole_grad), (split_loss, split_grad) = split_losses(config, WHOLE_AND_SPLIT)
    torch.testing.assert_close(split_loss, whole_loss)
    torch.testing.assert_close(split_grad, whole_grad)


CUSTOM_TERMS = """
import torch


def icepop(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths):
    ratio = torch.exp(logprobs - inference_logprobs)
    return -ratio * advantages * ((ratio >= 0.125) & (ratio <= 8.0))


def cispo(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths):
    weight = torch.exp(logprobs - inference_logprobs).detach().clamp(0.0, 5.0)
    return -weight * advantages * logprobs
"""


@pytest.mark.parametrize(("function", "built_in"), [("icepop", {}), ("cispo", {"bound": "cispo"})])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_a_custom_term_that_copies_a_built_in_one_gives_its_loss_and_gradient(
    tmp_path, monkeypatch, function, built_in, normalization
):
    (tmp_path / "my_terms.py").write_text(CUSTOM_TERMS)
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = LossConfig(custom=f"my_terms:{function}", normalization=normalization)
    reference = LossConfig(normalization=normalization, **built_in)
    custom_results = split_losses(custom, WHOLE_AND_SPLIT)
    ((reference_loss, reference_grad),) = split_losses(reference, WHOLE_AND_SPLIT[:1])
    for loss, grad in custom_results:  # whole and split into micro-batches alike
        torch.testing.assert_close(loss, reference_loss)
        torch.testing.assert_close(grad, reference_grad)
    _, _, metrics = corrected_loss(BATCH, custom=f"my_terms:{function}")
    assert "bounded_tokens" not in metrics  # what a custom term masks is its own
