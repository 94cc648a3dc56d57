"""Group-relative advantages."""

from jaxtyping import Float
from torch import Tensor


def group_advantages(rewards: Float[Tensor, "groups rollouts"]) -> Float[Tensor, "groups rollouts"]:
    """Each rollout's reward minus the mean reward of its group (rollouts of the same prompt).

    Naive equivalent: ``[[r - mean(group) for r in group] for group in rewards]``.
    """
    return rewards - rewards.mean(dim=1, keepdim=True)
