"""Why a rollout trains nothing. Each rollout of a step that gives the batch no trainable token gets one reason, the
first of :data:`REASONS` that applies; the step's metrics count them (``no_sample/<reason>``, docs/metrics.md) and,
when no rollout of the step trains, its error names them with their counts and most common causes
(:mod:`~orchestrator.batching.causes`).
"""

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from contracts.protocol import Sample
from contracts.run_dir import FAILED_ROLLOUTS, metrics_path
from orchestrator.batching.causes import causes
from orchestrator.batching.rollout import Rollout

REASONS = {  # reason: how the step's error says it ({seq_len} filled in)
    "lost": "in groups lost to infrastructure errors",
    "failed": "failed",
    "tied": "in groups whose rewards all tie (advantage.drop_uniform_groups or filter.refill)",
    "too_long": "longer than seq_len = {seq_len}",
    "truncated_masked": "truncated and masked (mask_truncated_completions)",
    "no_trainable_token": "with no trainable token",
}
SHOWN_CAUSES = 3  # the step's error names the most common causes of a reason's rollouts, this many at most


@dataclass
class Untrained:
    """A rollout that gave the batch no trainable token, and why (one of :data:`REASONS`)."""

    reason: str
    rollout: Rollout


def untrained_reason(rollout: Rollout, samples: list[Sample] | None, seq_len: int) -> str | None:
    """Why ``rollout`` trains nothing, or None when one of its ``samples`` (None: its group was left out for tying)
    fits in ``seq_len`` tokens with a trainable token (sampled, or with a cross-entropy weight). Its samples' masks
    are compared with its branches' to tell a truncated rollout masked as such from one that sampled nothing. Lost
    groups are told apart before."""
    if not rollout.ok:
        return "failed"
    if samples is None:
        return "tied"
    fitting = [s for s in samples if len(s.token_ids) <= seq_len]
    if any(any(s.loss_mask) or any(s.ce_weights or []) for s in fitting):
        return None
    if len(fitting) < len(samples):
        return "too_long"
    if rollout.truncated and any(any(b.loss_mask) for b in rollout.branches):
        return "truncated_masked"
    return "no_trainable_token"


def no_sample_metrics(untrained: list[Untrained]) -> dict[str, int]:
    """``no_sample/<reason>`` for every reason but ``failed`` (``failed_rollouts`` counts those): rollouts of the
    step that trained nothing, by why."""
    counts = Counter(u.reason for u in untrained)
    return {f"no_sample/{reason}": counts[reason] for reason in REASONS if reason != "failed"}


def no_sample_error(step: int, untrained: list[Untrained], seq_len: int) -> str:
    """The error of step ``step``, where no rollout trained: :func:`untrained_summary` of why, and where failed
    rollouts' full errors are."""
    summary = untrained_summary(untrained, seq_len)
    if any(u.reason in ("failed", "lost") for u in untrained):
        summary += f"; each failed rollout's full error is in the run's {metrics_path(Path(), FAILED_ROLLOUTS)}"
    return f"step {step}: no rollout produced a training sample: {summary}"


def untrained_summary(untrained: list[Untrained], seq_len: int) -> str:
    """Each reason of ``untrained`` with its count and its rollouts' most common error causes
    (:func:`~orchestrator.batching.causes.causes`: each with how many had it and where the first was; at most
    :data:`SHOWN_CAUSES`, the rest counted) or, for rollouts with no trainable token, how many made no model call; in
    :data:`REASONS`' order."""
    parts = []
    for reason, words in REASONS.items():
        rollouts = [u.rollout for u in untrained if u.reason == reason]
        if rollouts:
            said = _causes(rollouts, reason)
            parts.append(f"{len(rollouts)} {words.format(seq_len=seq_len)}" + (f" ({said})" if said else ""))
    return ", ".join(parts)


def _causes(rollouts: list[Rollout], reason: str) -> str:
    found = causes(rollouts)
    said = [f"{c.text} ×{c.count}, first in environment {c.first.env!r} (task {c.first.task})"
            for c in found[:SHOWN_CAUSES]]  # fmt: skip
    if rest := found[SHOWN_CAUSES:]:
        said.append(f"{sum(c.count for c in rest)} with {len(rest)} other causes")
    silent = sum(r.turns == 0 for r in rollouts)
    if reason == "no_trainable_token" and silent:
        said.append(f"{silent} made no model call")
    return "; ".join(said)
