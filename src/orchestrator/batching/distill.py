"""On-policy distillation's signal: on each sampled token, how much likelier the teacher finds it than the policy
that sampled it (the negative of the per-token reverse KL estimate, as in Thinking Machines' on-policy distillation
and prime-rl's ``opd``)."""

from orchestrator.batching.rollout import Branch, Rollout


def distill_advantages(branch: Branch, coef: float) -> list[float]:
    """Each token's advantage in ``branch``: ``coef * (teacher_logprob - sampled_logprob)`` where it is sampled
    (its loss mask), 0 elsewhere. Naive form: ``[coef * (t - s) if m else 0 for t, s, m in zip(teacher, sampled,
    mask)]``."""
    teacher = branch.teacher_logprobs
    if teacher is None:
        raise ValueError("a branch of an 'opd' environment has no teacher logprobs")
    return [coef * (t - s) if m else 0.0 for t, s, m in zip(teacher, branch.logprobs, branch.loss_mask, strict=True)]


def distilled(rollout: Rollout) -> bool:
    """Whether ``rollout``'s tokens were scored by a teacher (its environment is on ``opd``)."""
    return any(branch.teacher_logprobs is not None for branch in rollout.branches)


def loss_token_mean(values: list[float], loss_mask: list[bool]) -> float:
    """The mean of ``values`` over the tokens ``loss_mask`` trains (0 for none)."""
    kept = [v for v, m in zip(values, loss_mask, strict=True) if m]
    return sum(kept) / len(kept) if kept else 0.0


def reverse_kl_metrics(groups: list[list[Rollout]]) -> dict[str, float]:
    """``reverse_kl/<env>``: the mean over the sampled tokens of each distilled environment's rollouts of
    ``sampled_logprob - teacher_logprob`` (the per-token reverse KL estimate from student to teacher)."""
    by_env: dict[str, list[float]] = {}
    for rollout in (r for group in groups for r in group if r.ok and distilled(r)):
        gaps = by_env.setdefault(rollout.env, [])
        for branch in rollout.branches:
            sampled = zip(branch.logprobs, branch.teacher_logprobs or [], branch.loss_mask, strict=True)
            gaps.extend(s - t for s, t, m in sampled if m)
    return {f"reverse_kl/{env}": sum(gaps) / len(gaps) for env, gaps in sorted(by_env.items()) if gaps}
