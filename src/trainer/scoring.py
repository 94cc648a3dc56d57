"""Per-token logprobs and entropy through the LM head, chunk by chunk, at the positions that are needed only.

A policy-gradient step needs, at each trained position, the logprob of the sampled token (and the entropy of
the distribution when it is trained on or logged), never the logits themselves. Computing ``[tokens × vocab]``
logits at once costs 4.6 GiB in fp32 at 8,192 tokens and a 152k vocabulary, for every copy autograd keeps.
Here the policy's output layer is a :class:`ScoringHead`: inside :func:`scoring` it takes the hidden states of
the kept positions only (transformers' ``logits_to_keep``) and goes through them ``chunk_rows`` at a time, each
chunk's logits recomputed in the backward pass (activation checkpointing), so at most one chunk's logits exist
at any moment. Outside :func:`scoring` it is the plain linear layer. Being a module of the model, it runs
inside the model's forward, where FSDP has gathered its weight.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from contracts.sampling import NO_TRUNCATION, Truncation
from trainer.plan import chunk_rows
from trainer.truncation import truncated_logits

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedModel

# Positions per micro-batch whose entropy is computed when it is only logged (``logged`` mode), not trained on.
LOGGED_ENTROPY_POSITIONS = 128

Entropy = Literal["off", "logged", "trained"]


@dataclass(frozen=True)
class ScoreRequest:
    """What the head scores: the target token of each kept position, the sampling temperature, whether the
    entropy is computed (``logged``: at :func:`logged_entropy_rows` only, without gradient; ``trained``: at every
    position, with gradient), and the server's truncation of each distribution."""

    targets: Int[Tensor, " positions"]
    temperature: float
    entropy: Entropy
    truncation: Truncation = NO_TRUNCATION
    logged_rows: slice | None = None  # where ``logged`` computes it (None: :func:`logged_entropy_rows` of all)


_request: ContextVar[ScoreRequest | None] = ContextVar("trident_score_request", default=None)


@contextmanager
def scoring(
    targets: Int[Tensor, " positions"],
    temperature: float,
    entropy: Entropy = "off",
    truncation: Truncation = NO_TRUNCATION,
    logged_rows: slice | None = None,
) -> Iterator[None]:
    """Within this block a model's :class:`ScoringHead` returns scores ``[..., positions, 3]`` (logprob of each
    target, entropy or 0, 1 where the target lay outside the truncation's kept set) instead of logits; in ``logged``
    mode the entropy at ``logged_rows`` of the positions (None: :func:`logged_entropy_rows` of them all)."""
    token = _request.set(ScoreRequest(targets, temperature, entropy, truncation, logged_rows))
    try:
        yield
    finally:
        _request.reset(token)


def chunk_scores(
    hidden: Float[Tensor, "... positions hidden"],
    weight: Float[Tensor, "vocab hidden"],
    bias: Float[Tensor, " vocab"] | None,
    targets: Int[Tensor, "... positions"],
    temperature: float,
    entropy: Entropy,
    truncation: Truncation = NO_TRUNCATION,
) -> Float[Tensor, "... positions 3"]:
    """Logprob of each target after temperature and ``truncation`` (the distribution the server sampled from),
    the entropy of that distribution (0 when ``off``), and 1 where the target lay outside the kept set (0 else).

    Naive equivalent: ``logp = log_softmax(truncated((hidden @ weight.T + bias).float() / T))``, with
    :func:`~trainer.truncation.truncated_logits` as ``truncated``; ``logp[i, targets[i]]`` and
    ``-(logp.exp() * logp).sum(-1)`` over the kept tokens.
    """
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:  # a division by 1 changes no bit: spare its passes over the logits
        logits = logits / temperature
    sampled_from, outside = logits, None
    if truncation.on:
        sampled_from, outside = truncated_logits(logits, targets, truncation)  # dropped: -inf
    log_normalizer = sampled_from.logsumexp(-1)
    logprobs = logits.gather(-1, targets[..., None])[..., 0] - log_normalizer
    outside = torch.zeros_like(logprobs) if outside is None else outside.to(logprobs.dtype)
    if entropy == "off":
        return torch.stack([logprobs, torch.zeros_like(logprobs), outside], -1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy == "trained"):
        entropies = log_normalizer - (torch.softmax(sampled_from, -1) * logits).sum(-1)  # -Σ p log p, p 0 if dropped
    return torch.stack([logprobs, entropies, outside], -1)


def logged_entropy_rows(positions: int, first: int = 0) -> slice:
    """The positions (of ``positions`` scored ones) whose entropy ``logged`` mode computes: every ``stride``-th
    from the first, at most :data:`LOGGED_ENTROPY_POSITIONS` of them, spread over the whole row. As a slice of the
    scored positions from the ``first``-th on (a context-parallel shard's share)."""
    stride = max(1, -(-positions // LOGGED_ENTROPY_POSITIONS))
    return slice(-first % stride, None, stride)


def chunked_scores(
    hidden: Float[Tensor, "... positions hidden"], weight: Tensor, bias: Tensor | None, request: ScoreRequest
) -> Float[Tensor, "... positions 3"]:
    """:func:`chunk_scores` over ``hidden`` in chunks of :func:`chunk_rows` positions (the request's targets in
    the same layout); under autograd each chunk's logits are recomputed in the backward pass instead of kept.

    In ``logged`` mode the entropy is computed, without gradient, at the :func:`logged_entropy_rows` only (0
    elsewhere): an estimate for the metric at the cost of fewer than one chunk's logits, instead of a softmax over
    every position's logits, twice (forward and recomputation).
    """
    targets = request.targets.reshape(hidden.shape[:-1])
    if request.entropy != "logged":
        return _chunked(hidden, weight, bias, targets, request.temperature, request.entropy, request.truncation)
    scores = _chunked(hidden, weight, bias, targets, request.temperature, "off", request.truncation)
    rows = logged_entropy_rows(hidden.shape[-2]) if request.logged_rows is None else request.logged_rows
    with torch.no_grad():
        logged = _chunked(
            hidden[..., rows, :], weight, bias, targets[..., rows], request.temperature, "logged", request.truncation
        )
    entropies = torch.zeros_like(scores[..., 1])
    entropies[..., rows] = logged[..., 1]
    return torch.stack([scores[..., 0], entropies, scores[..., 2]], -1)


def _chunked(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    entropy: Entropy,
    truncation: Truncation,
) -> Tensor:
    rows = chunk_rows(weight.shape[0])
    pieces = []
    for start in range(0, hidden.shape[-2], rows):
        args = (hidden[..., start : start + rows, :], weight, bias, targets[..., start : start + rows])
        if torch.is_grad_enabled():
            pieces.append(checkpoint(chunk_scores, *args, temperature, entropy, truncation, use_reentrant=False))
        else:
            pieces.append(chunk_scores(*args, temperature, entropy, truncation))
    return torch.cat(pieces, dim=-2)


class ScoringHead(nn.Module):
    """A causal LM's output layer: logits, or within :func:`scoring` the scores of the positions it is given.

    It holds the original layer's parameters under the same names (``weight``, ``bias``), so state dicts, tied
    embeddings, peft and FSDP see the model they saw before.
    """

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.weight = head.weight
        self.register_parameter("bias", head.bias)

    def forward(self, hidden: Float[Tensor, "... hidden"]) -> Tensor:
        request = _request.get()
        if request is None:
            return F.linear(hidden, self.weight, self.bias)
        return chunked_scores(hidden, self.weight, self.bias, request)


def use_scoring_head(model: "PreTrainedModel") -> None:
    """Replace ``model``'s output layer by a :class:`ScoringHead` on the same parameters, in place."""
    model.set_output_embeddings(ScoringHead(model.get_output_embeddings()))
