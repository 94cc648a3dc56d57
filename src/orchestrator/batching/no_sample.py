"""Why a rollout trains nothing. Each rollout of a step that gives the batch no trainable token gets one reason, the
first of :data:`REASONS` that applies; the step's metrics count them (``no_sample/<reason>``, docs/metrics.md) and,
when no rollout of the step trains, its error names them with their counts and most common error.
"""

from collections import Counter
from dataclasses import dataclass

from contracts.errors import first_line
from contracts.protocol import Sample
from orchestrator.batching.rollout import Rollout

REASONS = {  # reason: how the step's error says it ({seq_len} filled in)
    "lost": "in groups lost to infrastructure errors",
    "failed": "failed",
    "tied": "in groups whose rewards all tie (advantage.drop_uniform_groups or filter.refill)",
    "too_long": "longer than seq_len = {seq_len}",
    "truncated_masked": "truncated and masked (mask_truncated_completions)",
    "no_trainable_token": "with no trainable token",
}
ERROR_CHARS = 200  # of an error's first line, quoted in the step's error


@dataclass
class Untrained:
    """A rollout that gave the batch no trainable token, and why (one of :data:`REASONS`)."""

    reason: str
    rollout: Rollout


def untrained_reason(rollout: Rollout, samples: list[Sample] | None, seq_len: int) -> str | None:
    """Why ``rollout`` trains nothing, or None when one of its ``samples`` (None: its group was left out for tying)
    fits in ``seq_len`` tokens with a trainable token. Its samples' masks are compared with its branches' to tell a
    truncated rollout masked as such from one that sampled nothing. Lost groups are told apart before."""
    if not rollout.ok:
        return "failed"
    if samples is None:
        return "tied"
    fitting = [s for s in samples if len(s.token_ids) <= seq_len]
    if any(any(s.loss_mask) for s in fitting):
        return None
    if len(fitting) < len(samples):
        return "too_long"
    if rollout.truncated and any(any(b.loss_mask) for b in rollout.branches):
        return "truncated_masked"
    return "no_trainable_token"


def error_type(error: str | None) -> str:
    """The type an error text starts with (``"InterceptionError: unauthorized"``: ``InterceptionError``), as the
    verifiers adapter writes them; ``other`` for a text that names none."""
    head = (error or "").split(":", 1)[0].strip()
    return head if head.isidentifier() else "other"


def error_line(error: str) -> str:
    """An error's first line, cut to :data:`ERROR_CHARS`."""
    return first_line(error, ERROR_CHARS)


def no_sample_metrics(untrained: list[Untrained]) -> dict[str, int]:
    """``no_sample/<reason>`` for every reason but ``failed`` (``failed_rollouts`` counts those): rollouts of the
    step that trained nothing, by why."""
    counts = Counter(u.reason for u in untrained)
    return {f"no_sample/{reason}": counts[reason] for reason in REASONS if reason != "failed"}


def no_sample_error(step: int, untrained: list[Untrained], seq_len: int) -> str:
    """The error of step ``step``, where no rollout trained: :func:`untrained_summary` of why."""
    return f"step {step}: no rollout produced a training sample: {untrained_summary(untrained, seq_len)}"


def untrained_summary(untrained: list[Untrained], seq_len: int) -> str:
    """Each reason of ``untrained`` with its count and its rollouts' most common error (how many had it, where the
    first was) or, for rollouts with no trainable token, how many made no model call; in :data:`REASONS`' order."""
    parts = []
    for reason, words in REASONS.items():
        rollouts = [u.rollout for u in untrained if u.reason == reason]
        if rollouts:
            causes = _causes(rollouts, reason)
            parts.append(f"{len(rollouts)} {words.format(seq_len=seq_len)}" + (f" ({causes})" if causes else ""))
    return ", ".join(parts)


def _causes(rollouts: list[Rollout], reason: str) -> str:
    errors = Counter(error_line(r.error) for r in rollouts if r.error)
    causes = []
    if errors:
        ((text, count),) = errors.most_common(1)
        first = next(r for r in rollouts if r.error and error_line(r.error) == text)
        causes.append(f"{text} ×{count}, first in environment {first.env!r} (task {first.task})")
        if count < errors.total():
            causes.append(f"{errors.total() - count} with other errors")
    silent = sum(r.turns == 0 for r in rollouts)
    if reason == "no_trainable_token" and silent:
        causes.append(f"{silent} made no model call")
    return "; ".join(causes)
