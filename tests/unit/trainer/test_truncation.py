"""The trainer's replay of the server's banned tokens and top_p / top_k / min_p: vLLM's kept sets, in vLLM's order,
and scores under the truncated, renormalised distribution (the sampled token always kept, nothing ever -inf or NaN)."""

import math

import pytest
import torch

from contracts.sampling import Truncation
from trainer.scoring import chunk_scores
from trainer.truncation import kept_tokens, truncated_logits

# probabilities 0.5, 0.3, 0.15, 0.05 (at temperature 1)
LOGITS = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


@pytest.mark.parametrize(
    "truncation, kept",
    [
        (Truncation(), [1, 1, 1, 1]),
        (Truncation(top_k=2), [1, 1, 0, 0]),
        (Truncation(top_k=3), [1, 1, 1, 0]),
        (Truncation(top_p=0.8), [1, 1, 0, 0]),  # 0.5 + 0.3 reaches 0.8
        (Truncation(top_p=0.81), [1, 1, 1, 0]),
        (Truncation(top_p=0.1), [1, 0, 0, 0]),  # the likeliest always stays
        (Truncation(min_p=0.2), [1, 1, 1, 0]),  # 0.05 < 0.2 * 0.5
        (Truncation(min_p=0.7), [1, 0, 0, 0]),
        # top_p counts the mass of what min_p and top_k kept: of 0.5 and 0.3 renormalised (0.625, 0.375)
        (Truncation(top_p=0.6, top_k=2), [1, 0, 0, 0]),
        (Truncation(top_p=0.7, min_p=0.2), [1, 1, 0, 0]),  # of 0.5, 0.3, 0.15 renormalised: 0.53 + 0.32 > 0.7
        (Truncation(banned=(1, 3)), [1, 0, 1, 0]),
        # banned first: min_p measures against the likeliest token left (0.3 when 0.5 is banned), top_k counts the rest
        (Truncation(banned=(0,), min_p=0.4), [0, 1, 1, 0]),  # 0.05 < 0.4 * 0.3 <= 0.15
        (Truncation(banned=(0,), top_k=1), [0, 1, 0, 0]),
        (Truncation(min_p=0.7, top_k=2), [1, 0, 0, 0]),  # top_k keeps no more than min_p left
    ],
)
def test_kept_tokens_hand_computed(truncation, kept):
    expected = [bool(k) for k in kept]
    assert kept_tokens(LOGITS[None], truncation)[0].tolist() == expected
    # positions laid out in two dimensions (sequences, tokens): the same set at each, over the vocabulary
    assert kept_tokens(LOGITS.expand(2, 3, 4), truncation).tolist() == [[expected] * 3] * 2


def test_each_position_keeps_its_own_set():
    logits = torch.stack([LOGITS, torch.zeros(4)])  # likeliest 0.5, and a uniform 0.25 each
    # min_p = 0.55 is against each position's own likeliest: 0.275 drops 0.15 and 0.05; 0.1375 drops nothing
    assert kept_tokens(logits, Truncation(min_p=0.55)).int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_min_p_keeps_a_token_exactly_at_its_threshold_and_no_truncation_keeps_every_token():
    halves = torch.tensor([[0.0, -math.log(2), -math.log(4)]])  # probabilities 4/7, 2/7, 1/7, exactly halving
    assert kept_tokens(halves, Truncation(min_p=0.5)).tolist() == [[True, True, False]]  # 2/7 >= 0.5 * 4/7
    assert kept_tokens(torch.tensor([[0.0, -200.0]]), Truncation()).tolist() == [[True, True]]  # e^-200 is 0 in fp32


def test_truncated_logits_keep_each_target_at_every_position():
    logits = LOGITS.expand(2, 3, 4)
    targets = torch.tensor([[3, 0, 3], [0, 3, 3]])
    truncated, outside = truncated_logits(logits, targets, Truncation(top_k=1))  # keeps token 0
    assert outside.tolist() == [[True, False, True], [False, True, True]]
    assert torch.isfinite(truncated).int().tolist() == [
        [[1, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1]],
        [[1, 0, 0, 0], [1, 0, 0, 1], [1, 0, 0, 1]],
    ]


def test_scores_are_those_of_the_truncated_renormalised_distribution():
    hidden = LOGITS[None].repeat(2, 1)  # with an identity head, the logits
    truncation = Truncation(top_k=2)
    scores = chunk_scores(hidden, torch.eye(4), None, torch.tensor([1, 0]), 1.0, "logged", truncation)
    assert math.isclose(scores[0, 0].item(), math.log(0.3 / 0.8), rel_tol=1e-6)
    assert math.isclose(scores[1, 0].item(), math.log(0.5 / 0.8), rel_tol=1e-6)
    entropy = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))  # of the kept two, renormalised
    assert torch.allclose(scores[:, 1], torch.tensor([entropy] * 2))
    assert not scores[:, 2].any()  # both targets inside the kept set
    full = chunk_scores(hidden, torch.eye(4), None, torch.tensor([1, 0]), 1.0, "off")
    # without replay, each logprob is off by the log of the kept mass
    assert torch.allclose(full[:, 0] - scores[:, 0], torch.tensor(math.log(0.8)).expand(2))


def test_a_sampled_token_outside_the_trainers_kept_set_scores_finite_with_finite_gradients():
    """Where the trainer's logits differ from the server's (newer weights), the sampled token may fall outside its
    kept set: it counts as kept, so the loss and its gradient stay finite."""
    hidden = LOGITS[None].clone().requires_grad_()
    truncation = Truncation(top_p=0.5, top_k=1, min_p=0.9)  # keeps token 0 only
    scores = chunk_scores(hidden, torch.eye(4), None, torch.tensor([3]), 1.0, "trained", truncation)
    assert math.isclose(scores[0, 0].item(), math.log(0.05 / 0.55), rel_tol=1e-6)  # among token 0 and itself
    assert scores[0, 2] == 1  # counted for the outside_kept_fraction metric
    scores.sum().backward()
    assert torch.isfinite(scores).all() and torch.isfinite(hidden.grad).all()
    assert hidden.grad[0, 1:3].abs().max() == 0  # the dropped tokens take no gradient


def test_chunked_scores_with_truncation_equal_the_naive_ones():
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(6, 8, generator=generator), torch.randn(50, 8, generator=generator)
    targets = torch.randint(0, 50, (6,), generator=generator)
    truncation = Truncation(top_p=0.9, top_k=20, min_p=0.05)
    scores = chunk_scores(hidden, weight, None, targets, 0.7, "trained", truncation)
    logits = hidden @ weight.T / 0.7
    keep = kept_tokens(logits, truncation)
    keep[torch.arange(6), targets] = True
    logp = torch.log_softmax(logits.masked_fill(~keep, -torch.inf), -1)
    assert torch.allclose(scores[:, 0], logp[torch.arange(6), targets], atol=1e-6)
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0)).sum(-1)
    assert torch.allclose(scores[:, 1], entropy, atol=1e-6)


def test_banned_tokens_score_as_the_servers_bad_words_renormalise():
    hidden = LOGITS[None]
    scores = chunk_scores(hidden, torch.eye(4), None, torch.tensor([0]), 1.0, "off", Truncation(banned=(2, 3)))
    assert math.isclose(scores[0, 0].item(), math.log(0.5 / 0.8), rel_tol=1e-6)  # 0.15 + 0.05 of the mass banned
