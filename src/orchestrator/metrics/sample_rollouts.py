"""A few rollouts of a step as readable rows: the table of sample rollouts (JSON lines and W&B)."""

from collections.abc import Callable

from orchestrator.batching.rollout import Rollout
from orchestrator.metrics.stats import split_lengths

MAX_CHARS = 2000  # per prompt or completion in a row


def shorten(text: str, limit: int = MAX_CHARS) -> str:
    """``text`` cut to about ``limit`` characters by dropping its middle: a chat's start and end matter most."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} […] {text[-half:]}"


def prompt_and_completion(rollout: Rollout) -> tuple[list[int], list[int]]:
    """A rollout's prompt (its first sample up to the first trained token) and the tokens after that prompt in its
    last sample: for a rollout split into several samples, the conversation as it ended."""
    if not rollout.branches:
        return [], []
    first, last = rollout.branches[0], rollout.branches[-1]
    prompt = first.token_ids[: split_lengths(first.loss_mask)[0]]
    completion = last.token_ids if last.token_ids[: len(prompt)] == prompt else first.token_ids
    return prompt, completion[len(prompt) :]


def sample_rows(
    step: int,
    groups: list[list[Rollout]],
    rewards: list[list[float]],
    advantages: list[list[float]],
    decode: Callable[[list[int]], str],
) -> list[dict]:
    """One row per rollout of the step's first group of each environment, its text decoded with ``decode``
    (special tokens kept: the text the model saw) and shortened to ``MAX_CHARS``; ``rewards`` holds the score of
    each of its reward functions, an ``[env.judge]``'s verdict among them (1 for yes, 0 for no)."""
    first_group = {}
    for i, group in enumerate(groups):
        if group:
            first_group.setdefault(group[0].env, i)
    rows = []
    for g in first_group.values():
        for r, rollout in enumerate(groups[g]):
            prompt, completion = prompt_and_completion(rollout)
            rows.append(
                {
                    "step": step,
                    "env": rollout.env,
                    "task": rollout.task,
                    "seat": rollout.seat,
                    "prompt": shorten(decode(prompt)),
                    "completion": shorten(decode(completion)),
                    "reward": rewards[g][r],
                    "rewards": rollout.rewards,
                    "advantage": advantages[g][r],
                    "truncated": rollout.truncated,
                }
            )
    return rows
