"""Finished rollouts made by hand, as the verifiers adapter returns them, for the orchestrator's tests."""

from collections.abc import Iterable

from orchestrator.batching.batch import flat, rollout_samples
from orchestrator.batching.rollout import Branch, Rollout


def sampled(ids: list[int], first: int, logprobs: list[float], **parts) -> Branch:
    """A branch whose tokens from ``first`` on were sampled, with ``logprobs``; those before are its prompt's.
    ``parts``: its other fields (routes, weight_steps, images)."""
    return Branch(ids, [i >= first for i in range(len(ids))], [0.0] * first + logprobs, **parts)


def masked(mask: str) -> Branch:
    """A branch written as its loss mask: '.' a prompt or tool token, 's' a sampled one (logprob -1); ids 0, 1, ..."""
    return Branch(list(range(len(mask))), [c == "s" for c in mask], [-1.0 if c == "s" else 0.0 for c in mask])


ONE_SAMPLED = sampled([1, 2], 1, [-1.0])  # a prompt token, then one sampled
TWO_SAMPLED = sampled([1, 2, 3], 1, [-1.0, -1.0])  # a prompt token, then two sampled


def rollout(reward: float, *branches: Branch, ok: bool = True, **fields) -> Rollout:
    """A finished rollout of ``branches`` (none: a failed rollout's); ``fields``: the other fields of Rollout."""
    return Rollout(reward=reward, branches=list(branches), ok=ok, **fields)


def group(rewards: Iterable[float], *branches: Branch, **fields) -> list[Rollout]:
    """A rollout of ``branches`` for each of ``rewards``: a group."""
    return [rollout(float(reward), *branches, **fields) for reward in rewards]


def build_samples(groups: list[list[Rollout]], weight_step: int, **options):
    """The samples of ``groups`` in one list, and the rewards and advantages they were built from
    (:func:`orchestrator.batching.batch.rollout_samples`, flattened)."""
    per_rollout, rewards, advantages = rollout_samples(groups, weight_step, **options)
    return flat(per_rollout), rewards, advantages
