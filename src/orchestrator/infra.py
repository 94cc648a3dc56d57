"""Infrastructure errors are not rollout outcomes.

verifiers 0.4.0 records where a rollout broke as the type of its error (``verifiers.v1.errors``). A tool server
that did not start or answer (``ToolsetError``), a runtime or sandbox (``SandboxError``), the interception server
(``InterceptionError``, ``TunnelError``), a set-up past ``infra.setup_timeout_s`` (``SetupTimeoutError``), a judge
that did not score a completion (``JudgeError``: its call failed or its reply held no verdict), and a model call
the server did not answer (``ProviderError`` with a 5xx or 429 status: connection refused, timeout, overload) say
nothing about the policy: such a rollout is run
again, and if it keeps failing its group is lost, not scored. Everything else (a task's or harness's own code
raising, a model call refused as too long, a timeout) stays the rollout's outcome.
"""

from collections import defaultdict
from typing import TYPE_CHECKING

import verifiers.v1 as vf

from contracts.errors import TridentError

if TYPE_CHECKING:
    from orchestrator.envs import Rollout

INFRA_TYPES = {"ToolsetError", "SandboxError", "InterceptionError", "TunnelError", "SetupTimeoutError", "JudgeError"}


def is_infra(error: vf.Error | None) -> bool:
    """Whether ``error`` (as verifiers recorded it) is the infrastructure's, not the rollout's."""
    if error is None:
        return False
    if error.type == "ProviderError":
        return error.status_code is None or error.status_code >= 500 or error.status_code == 429
    return error.type in INFRA_TYPES


def is_lost(group: list["Rollout"]) -> bool:
    """A group is lost when one of its rollouts kept failing with infrastructure errors."""
    return any(r.lost for r in group)


def check_lost(step: int, groups: list[list["Rollout"]], max_share: float) -> None:
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


def infra_metrics(groups: list[list["Rollout"]]) -> dict[str, float]:
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
