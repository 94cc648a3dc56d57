"""Distillation from a teacher's samples (``algorithm = "sft"``): the teacher's server sampled the rollout, so the
policy trains on its sampled tokens by cross-entropy (their likelihood under the policy), with no policy-gradient
term: the policy did not sample them, and their logprobs are the teacher's."""

from orchestrator.batching.rollout import Branch, Rollout


def taught(branch: Branch) -> Branch:
    """``branch`` (sampled by the teacher) as the policy trains it: cross-entropy weight 1 on each sampled token, an
    empty loss mask and no logprobs (no policy-gradient term)."""
    n = len(branch.token_ids)
    branch.ce_weights = [1.0 if m else 0.0 for m in branch.loss_mask]
    branch.ce_roles = ["assistant"]
    branch.loss_mask, branch.logprobs, branch.weight_steps = [False] * n, [0.0] * n, None
    return branch


def set_teacher_sample_weights(groups: list[list[Rollout]]) -> None:
    """Make every branch of the finished rollouts of ``groups`` :func:`taught`."""
    for branch in (b for group in groups for r in group if r.ok for b in r.branches):
        taught(branch)


def cross_entropy_only(rollout: Rollout) -> bool:
    """Whether ``rollout`` trains by cross-entropy only (no sampled token of the policy's): its advantage means
    nothing."""
    return any(b.ce_weights for b in rollout.branches) and not any(any(b.loss_mask) for b in rollout.branches)
