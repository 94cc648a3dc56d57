import math

import pytest
import torch

import trainer.plan
from contracts.protocol import MicroBatch, Sample
from trainer import scoring
from trainer.attention import packing
from trainer.config import TrainerModelConfig
from trainer.model import load_model, packed_scores
from trainer.scoring import ScoreRequest, chunk_scores, chunked_scores


def test_chunk_scores_apply_temperature_hand_computed():
    hidden = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]])  # with an identity head, the logits
    scores = chunk_scores(hidden, torch.eye(3), None, torch.tensor([1, 0]), temperature=0.5, entropy="logged")
    # row 0 at T = 0.5: logits [0, 2, 4], target 1
    assert math.isclose(scores[0, 0].item(), 2 - math.log(1 + math.exp(2) + math.exp(4)), rel_tol=1e-6)
    # row 1 at T = 0.5: logits [4, 0, 0], target 0
    assert math.isclose(scores[1, 0].item(), 4 - math.log(math.exp(4) + 2), abs_tol=1e-6)
    for row in range(2):
        p = torch.softmax(hidden[row] / 0.5, -1)
        assert math.isclose(scores[row, 1].item(), -(p * p.log()).sum().item(), rel_tol=1e-5)
    off = chunk_scores(hidden, torch.eye(3), None, torch.tensor([1, 0]), temperature=0.5, entropy="off")
    assert torch.equal(off[:, 0], scores[:, 0]) and not off[:, 1].any()


def naive_scores(hidden, weight, bias, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature, -1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("entropy", ["trained", "logged"])
def test_chunked_scores_equal_the_naive_ones_in_values_and_gradients(monkeypatch, entropy):
    monkeypatch.setattr(trainer.plan, "CHUNK_ELEMENTS", 3 * 50)  # 3 positions a chunk: 4 chunks, the last short
    monkeypatch.setattr(scoring, "LOGGED_ENTROPY_POSITIONS", 4)  # logged: positions 0, 3, 6, 9
    generator = torch.Generator().manual_seed(0)
    hidden, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((10, 8), (50, 8), (50,)))
    targets = torch.randint(0, 50, (10,), generator=generator)
    coefficients = torch.randn(2, 10, generator=generator)  # a loss that weighs logprobs and entropies

    def gradients(compute):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        logprobs, entropies = compute(*leaves)
        (coefficients[0] * logprobs + coefficients[1] * entropies).sum().backward()
        return logprobs.detach(), entropies.detach(), [leaf.grad for leaf in leaves]

    def chunked(h, w, b):
        scores = chunked_scores(h, w, b, ScoreRequest(targets, 0.7, entropy))
        return scores[:, 0], scores[:, 1]

    def naive(h, w, b):
        logprobs, entropies = naive_scores(h, w, b, targets, 0.7)
        logged = torch.zeros(10, dtype=torch.bool).index_fill(0, torch.tensor([0, 3, 6, 9]), True)
        return logprobs, entropies if entropy == "trained" else entropies.detach() * logged

    got, expected = gradients(chunked), gradients(naive)
    for g, e in zip(got[:2] + tuple(got[2]), expected[:2] + tuple(expected[2]), strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def tiny_micro_batch(lengths, loss_from):
    generator = torch.Generator().manual_seed(1)
    samples = []
    for n in lengths:
        ids = torch.randint(0, 2000, (n,), generator=generator).tolist()
        samples.append(Sample(ids, [i >= loss_from for i in range(n)], [0.0] * n, 1.0, 0.0, 0))
    return MicroBatch.pack(samples)


def test_packed_scores_hold_no_vocabulary_wide_tensor_and_match_full_logits(tiny_model_path, monkeypatch):
    """On the tiny model: scores only at the asked positions, equal to the full logits' log_softmax; the backward
    keeps no ``[tokens × vocab]`` tensor (autograd's saved tensors are recorded)."""
    monkeypatch.setattr(trainer.plan, "CHUNK_ELEMENTS", 4 * 2048)  # 4 positions a chunk at the tiny vocabulary
    model = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    micro_batch = tiny_micro_batch((12, 9, 15), loss_from=3)
    parameters = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in parameters:  # activations only
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropies, entropy_mask, _ = packed_scores(model, micro_batch, 0.7, micro_batch.loss_mask, "trained")
    (logprobs + entropies).sum().backward()
    tokens, vocab = len(micro_batch.input_ids), model.config.vocab_size
    assert max(saved) < tokens * vocab // 4, "a vocabulary-wide tensor of the whole row was kept for backward"
    got = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    row = packing(micro_batch.sample_lengths, torch.device("cpu"))
    hidden = base.model(input_ids=micro_batch.input_ids[None], position_ids=micro_batch.position_ids[None],
                        packing=row).last_hidden_state[0]  # fmt: skip
    head = base.get_output_embeddings()
    logp = torch.log_softmax(torch.nn.functional.linear(hidden[:-1], head.weight) / 0.7, -1)
    expected_logprobs = torch.cat([torch.zeros(1), logp.gather(-1, micro_batch.input_ids[1:, None])[:, 0]])
    expected_entropies = torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)])
    mask = micro_batch.loss_mask
    ((expected_logprobs + expected_entropies) * mask).sum().backward()
    torch.testing.assert_close(logprobs, expected_logprobs * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, expected_entropies * mask, atol=1e-5, rtol=1e-5)
    assert torch.equal(entropy_mask, mask & (micro_batch.position_ids > 0))
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-4)


def test_logged_entropy_is_the_trained_one_on_a_strided_subset_without_gradient(tiny_model_path, monkeypatch):
    """With ``entropy_coef`` 0 the head computes the entropy (for the metric) at every ``stride``-th scored
    position only, spread over the row, equal there to the trained mode's values, and 0 elsewhere."""
    monkeypatch.setattr(scoring, "LOGGED_ENTROPY_POSITIONS", 5)
    model = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    micro_batch = tiny_micro_batch((12, 9, 15), loss_from=3)  # 9 + 6 + 12 = 27 scored positions: stride 6
    trained = packed_scores(model, micro_batch, 0.7, micro_batch.loss_mask, "trained")
    logged = packed_scores(model, micro_batch, 0.7, micro_batch.loss_mask, "logged")
    scored = trained.entropy_mask.nonzero()[:, 0]
    assert len(scored) == 27 and torch.equal(logged.entropy_mask.nonzero()[:, 0], scored[::6])
    torch.testing.assert_close(logged.logprobs, trained.logprobs)
    torch.testing.assert_close(logged.entropy, trained.entropy.detach() * logged.entropy_mask)
    parameters = [p for p in model.parameters() if p.requires_grad]
    gradients = torch.autograd.grad(logged.entropy.sum(), parameters, allow_unused=True)
    assert all(g is None or not g.any() for g in gradients), "the logged entropy is off the graph"
