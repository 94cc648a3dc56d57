"""Infrastructure errors are not rollout outcomes.

A rollout whose infrastructure failed (a tool server, a runtime, a judge, a model call the server did not answer:
:func:`~orchestrator.verifiers_adapter.envs.is_infra` tells them apart) says nothing about the policy: it is run
again, and if it keeps failing it is marked ``lost`` and its group is lost, not scored. Everything else (a task's or
harness's own code raising, a model call refused as too long, a timeout) stays the rollout's outcome.
"""

from collections import defaultdict

from contracts.errors import TridentError
from orchestrator.batching.rollout import Rollout


def is_lost(group: list[Rollout]) -> bool:
    """A group is lost when one of its rollouts kept failing with infrastructure errors."""
    return any(r.lost for r in group)


def check_lost(step: int, groups: list[list[Rollout]], max_share: float) -> None:
    """Refuse step ``step`` when more than ``max_share`` of its groups (or all) are lost, naming the first cause."""
    lost = [group for group in groups if is_lost(group)]
    if not lost or (len(lost) <= max_share * len(groups) and len(lost) < len(groups)):
        return
    first = next(r for r in lost[0] if r.lost)
    raise TridentError(
        f"step {step}: {len(lost)} of {len(groups)} groups lost to infrastructure errors (more than "
        f"infra.max_lost_groups = {max_share}); first in environment {first.env!r} (task {first.task}), "
        f"after {first.retries} retries: {first.error}"
    )


def infra_metrics(groups: list[list[Rollout]]) -> dict[str, float]:
    """Per environment: retries after infrastructure errors, lost rollouts and groups, and set-up seconds (mean and
    max over the rollouts whose set-up finished)."""
    out: dict[str, float] = defaultdict(float)
    setups: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        env = group[0].env
        out[f"infra/{env}/retries"] += sum(r.retries for r in group)
        out[f"infra/{env}/lost_rollouts"] += sum(r.lost for r in group)
        out[f"infra/{env}/lost_groups"] += is_lost(group)
        setups[env] += [r.setup_s for r in group if r.setup_s is not None]
    for env, seconds in setups.items():
        if seconds:
            out[f"infra/{env}/setup_s_mean"] = sum(seconds) / len(seconds)
            out[f"infra/{env}/setup_s_max"] = max(seconds)
    return dict(sorted(out.items()))
