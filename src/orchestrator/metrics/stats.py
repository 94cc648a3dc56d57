"""Per-step statistics of rollouts and training samples, as the orchestrator logs them (see docs/metrics.md)."""

import itertools
import statistics
from collections import Counter
from collections.abc import Sequence

from contracts.protocol import Sample
from orchestrator.batching.advantage import uniform_groups
from orchestrator.batching.causes import error_type
from orchestrator.batching.rollout import Rollout


def describe(name: str, values: Sequence[float], stats: Sequence[str] = ("mean", "std", "min", "max")) -> dict:
    """``{name}_{stat}`` for each of ``stats`` over ``values``: the std is unbiased (0 for fewer than 2 values);
    an empty ``values`` gives no keys."""
    if not values:
        return {}
    compute = {
        "mean": statistics.fmean,
        "std": lambda v: statistics.stdev(v) if len(v) > 1 else 0.0,
        "min": min,
        "max": max,
    }
    return {f"{name}_{stat}": compute[stat](values) for stat in stats}


def split_lengths(mask: Sequence[bool]) -> tuple[int, int]:
    """(prompt, completion) tokens of one sample: the prompt is everything before its first trained token."""
    prompt = next((i for i, sampled in enumerate(mask) if sampled), len(mask))
    return prompt, len(mask) - prompt


def rollout_metrics(groups: list[list[Rollout]], rewards: list[list[float]], generate_s: float) -> dict[str, float]:
    """What the rollouts of one step got and produced, and how fast (``generate_s``: seconds spent generating).

    ``rewards`` (a row per group) are the scores advantages were computed from (``rollout.reward``, or 0 for
    truncated rollouts under ``zero_truncated_completions``), ``reward_*`` those of the trained rollouts (not an
    untrained seat's); ``reward/<function>`` is each reward function's raw mean over the rollouts it scored,
    ``metric/<name>`` each environment metric's mean over the rollouts that report it; ``seat/<seat>/*`` each seat's
    (:func:`seat_metrics`), when the rollouts hold several seats.
    ``failed/<type>`` counts the failed rollouts by their error's type
    (:func:`~orchestrator.batching.causes.error_type`).
    Lengths are in tokens, one value per sample (a rollout split into several samples gives
    several); the completion runs from the first trained token to the end, tool results included.
    """
    rollouts = [r for group in groups for r in group]
    # the policy's score: an untrained seat's (a simulated user, a pinned opponent) is not
    policy_rewards = [reward for reward, r in zip(itertools.chain(*rewards), rollouts, strict=True) if r.trained]
    branches = [b for r in rollouts for b in r.branches]
    lengths = [split_lengths(b.loss_mask) for b in branches]
    by_function: dict[str, list[float]] = {}
    by_metric: dict[str, list[float]] = {}
    for rollout in rollouts:
        for function, score in rollout.rewards.items():
            by_function.setdefault(function, []).append(score)
        for name, value in rollout.metrics.items():
            by_metric.setdefault(name, []).append(value)
    failed = Counter(error_type(r.error) for r in rollouts if not r.ok)
    sampled_tokens = sum(sum(b.loss_mask) for b in branches)
    seconds = max(generate_s, 1e-9)
    return {
        **describe("reward", policy_rewards, ("mean", "std")),
        **seat_metrics(rollouts, list(itertools.chain(*rewards))),
        **{f"reward/{function}": statistics.fmean(scores) for function, scores in sorted(by_function.items())},
        **{f"metric/{name}": statistics.fmean(values) for name, values in sorted(by_metric.items())},
        "uniform_groups": statistics.fmean(uniform_groups(rewards)),
        "truncated_rate": sum(r.truncated for r in rollouts) / len(rollouts),
        "failed_rollouts": failed.total(),
        **{f"failed/{kind}": count for kind, count in sorted(failed.items())},
        "turns_mean": statistics.fmean(r.turns for r in rollouts),
        "sampled_tokens": sampled_tokens,
        "rollouts_per_s": len(rollouts) / seconds,
        "sampled_tokens_per_s": sampled_tokens / seconds,
        **describe("sequence_len", [len(b.token_ids) for b in branches], ("mean", "max")),
        **describe("prompt_len", [prompt for prompt, _ in lengths], ("mean", "max")),
        **describe("completion_len", [completion for _, completion in lengths], ("mean", "max")),
    }


def seat_metrics(rollouts: list[Rollout], rewards: list[float]) -> dict[str, float]:
    """Each seat's ``seat/<seat>/reward_mean`` and ``reward_std`` over its rollouts (``rewards``, one per rollout;
    an untrained seat's too: the opponent's or the proposer's score) and ``seat/<seat>/sampled_tokens`` (its trained
    tokens: 0 for an untrained seat); none when every rollout is one seat's (a single-agent environment)."""
    by_seat: dict[str, list[int]] = {}
    for i, rollout in enumerate(rollouts):
        by_seat.setdefault(rollout.seat, []).append(i)
    if len(by_seat) < 2:
        return {}
    return {
        f"seat/{seat}/{name}": value
        for seat, rows in sorted(by_seat.items())
        for name, value in {
            **describe("reward", [rewards[i] for i in rows], ("mean", "std")),
            "sampled_tokens": sum(sum(b.loss_mask) for i in rows for b in rollouts[i].branches),
        }.items()
    }


def env_metrics(groups: list[list[Rollout]], rewards: list[list[float]], generate_s: float) -> dict[str, float]:
    """:func:`rollout_metrics` of each environment's groups, as ``env/<id>/<metric>`` (throughput left out: the
    environments generate at the same time)."""
    by_env: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        by_env.setdefault(group[0].env, []).append(i)
    return {
        f"env/{env}/{name}": value
        for env, rows in sorted(by_env.items())
        for name, value in rollout_metrics([groups[i] for i in rows], [rewards[i] for i in rows], generate_s).items()
        if not name.endswith("_per_s")
    }


def advantage_metrics(samples: list[Sample]) -> dict[str, float]:
    """Mean, std, min and max of the advantages of the samples the trainer gets (one value per sample)."""
    return describe("advantage", [s.advantage for s in samples])


def token_staleness_metrics(step: int, samples: list[Sample]) -> dict[str, float]:
    """How stale the sampled tokens of step ``step``'s ``samples`` are: a token sampled by weights step K is
    ``step - 1 - K`` steps stale (0: the newest weights the step could have). ``token_staleness_{mean,max}``, the
    share of tokens stale at all (``stale_token_share``) and the share of samples whose tokens came from more than
    one step (``mixed_step_samples``: weights changed while they were generated, in flight)."""
    counts = Counter(step - 1 - k for s in samples for k, m in zip(s.weight_steps, s.loss_mask, strict=True) if m)
    total = sum(counts.values())
    if not total:
        return {}
    mixed = sum(len({k for k, m in zip(s.weight_steps, s.loss_mask, strict=True) if m}) > 1 for s in samples)
    return {
        "token_staleness_mean": sum(age * n for age, n in counts.items()) / total,
        "token_staleness_max": max(counts),
        "stale_token_share": sum(n for age, n in counts.items() if age > 0) / total,
        "mixed_step_samples": mixed / len(samples),
    }
