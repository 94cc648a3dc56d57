"""Reward weights set in an environment's config (``<reward>_weight`` fields), plugged into its task config: the
code the environments of this workspace share. Not an environment itself."""

import verifiers.v1 as vf


def with_reward_weights(task: vf.TaskConfig, weights: dict[str, float]) -> vf.TaskConfig:
    """``task`` with the reward functions named in ``weights`` weighted so; a weight the run sets under
    ``task.rewards`` wins."""
    plugged = {name: vf.RewardFunctionConfig(weight=weight) for name, weight in weights.items()}
    return task.model_copy(update={"rewards": plugged | dict(task.rewards)})


__all__ = ["with_reward_weights"]
