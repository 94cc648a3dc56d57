"""A step's training batch, assembled from its finished groups by a pure function: no server, no disk, the same
batch for the same groups. What it holds is the disk protocol's (docs/protocol.md, :mod:`contracts.protocol`).
"""

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from contracts.errors import TridentError
from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_samples, sample_summary
from orchestrator.advantage import baseline_groups, group_advantages, group_rewards, uniform_baselines
from orchestrator.config import AdvantageConfig
from orchestrator.infra import is_lost
from orchestrator.rollout import Rollout


def build_samples(
    groups: list[list[Rollout]],
    weight_step: int,
    mask_truncated: bool = False,
    zero_truncated: bool = False,
    advantage: AdvantageConfig | None = None,
) -> tuple[list[Sample], Float[Tensor, "groups rollouts"], Float[Tensor, "groups rollouts"]]:
    """Training samples from groups of rollouts, with group-relative advantages; also the rewards and advantages
    they were built from.

    ``zero_truncated`` scores rollouts cut off by max_tokens 0; ``mask_truncated`` trains none of their tokens.
    Rollouts share a baseline as ``advantage.baseline_groups`` says (:func:`~orchestrator.advantage.baseline_groups`:
    by default those of one task and one seat). Failed rollouts (the environment raised) give no sample, and the
    baseline they would have shared is the others'.
    """
    rewards = torch.tensor([group_rewards(group, zero_truncated) for group in groups], dtype=torch.float32)
    advantage = advantage or AdvantageConfig()
    advantages = torch.zeros_like(rewards)
    for i, group in enumerate(groups):
        for members in baseline_groups(group, advantage.baseline_groups):
            if ok := [j for j in members if group[j].ok]:
                advantages[i, ok] = group_advantages(rewards[i, ok][None], advantage)[0]
    dropped = [
        advantage.drop_uniform_groups and uniform_baselines(group, row, advantage.baseline_groups)
        for group, row in zip(groups, rewards.tolist(), strict=True)
    ]
    if all(dropped):  # keep a step whose groups all tie: it trains nothing, but the run goes on
        dropped = [False] * len(groups)
    samples = []
    for group, rewards_row, advantages_row, drop in zip(
        groups, rewards.tolist(), advantages.tolist(), dropped, strict=True
    ):
        if drop:
            continue
        for rollout, reward, advantage in zip(group, rewards_row, advantages_row, strict=True):
            if not rollout.ok:
                continue
            meta = {"env": rollout.env, "task": rollout.task, "seat": rollout.seat, "rewards": rollout.rewards,
                    "metrics": rollout.metrics, "truncated": rollout.truncated, "turns": rollout.turns}  # fmt: skip
            for token_ids, mask, logprobs in rollout.branches:
                if mask_truncated and rollout.truncated:
                    mask = [False] * len(mask)
                samples.append(Sample(token_ids, mask, logprobs, advantage, reward, weight_step, meta))
    return samples, rewards, advantages


@dataclass
class Batch:
    """A step's batch as the trainer reads it, and what it was built from."""

    groups: list[list[Rollout]]  # the groups that count: those not lost to infrastructure errors
    weight_step: int  # the weights served when the groups started
    rewards: Float[Tensor, "groups rollouts"]  # of ``groups``, as advantages saw them
    advantages: Float[Tensor, "groups rollouts"]
    samples: list[Sample]  # in the order the micro-batches hold them
    micro_batches: list[MicroBatch]
    overlong: int  # samples left out for being longer than seq_len

    @property
    def failed(self) -> list[Rollout]:
        """The rollouts of ``groups`` that failed (the environment raised): they gave no sample."""
        return [r for group in self.groups for r in group if not r.ok]

    @property
    def empty(self) -> int:
        """Samples with no trainable token."""
        return sum(not any(s.loss_mask) for s in self.samples)

    def info(self, step: int, temperature: float, reward_mean: float, metrics: dict[str, float]) -> BatchInfo:
        """``batch.json`` of this batch as the batch of ``step``."""
        return BatchInfo(
            step=step,
            num_samples=len(self.samples),
            num_tokens=sum(len(s.token_ids) for s in self.samples),
            num_loss_tokens=sum(sum(s.loss_mask) for s in self.samples),
            reward_mean=reward_mean,
            temperature=temperature,
            weight_steps=[self.weight_step],
            metrics=metrics,
            samples=[sample_summary(s) for s in self.samples],
        )


def assemble_batch(
    step: int,
    groups: list[list[Rollout]],
    weight_step: int,
    seq_len: int,
    advantage: AdvantageConfig | None = None,
    mask_truncated: bool = False,
    zero_truncated: bool = False,
) -> Batch:
    """The batch of step ``step`` from its finished groups (sampled from weights ``weight_step``).

    Groups lost to infrastructure errors are left out; the others give :func:`build_samples`' samples, those longer
    than ``seq_len`` tokens left out, packed into micro-batches of at most ``seq_len`` tokens (first fit, longest
    first). A :class:`TridentError` naming the first error when every rollout failed or no sample is left, or naming
    the environments when groups hold different numbers of rollouts (several seats play each episode of one).
    """
    kept = [group for group in groups if not is_lost(group)]
    rollouts = [r for group in kept for r in group]
    failed = [r for r in rollouts if not r.ok]
    if not rollouts:
        raise TridentError(f"step {step}: no rollout to train on (all {len(groups)} groups lost)")
    if len(failed) == len(rollouts):
        raise TridentError(
            f"step {step}: all {len(rollouts)} rollouts failed; first, in environment {failed[0].env!r} "
            f"(task {failed[0].task}): {failed[0].error}"
        )
    sizes = dict.fromkeys((group[0].env, len(group)) for group in kept)  # in order, each once
    if len({size for _, size in sizes}) > 1:
        counts = ", ".join(f"{env!r} gives {size}" for env, size in sizes)
        raise TridentError(
            f"step {step}: environments give different numbers of rollouts per task ({counts}: rollouts_per_example "
            "times the seats that play each episode); a run's environments must give the same number for now"
        )
    samples, rewards, advantages = build_samples(kept, weight_step, mask_truncated, zero_truncated, advantage)
    fitting = [s for s in samples if len(s.token_ids) <= seq_len]
    if not fitting:
        reason = f"first error: {failed[0].error}" if failed else f"all longer than seq_len = {seq_len}"
        raise TridentError(f"step {step}: no rollout produced a training sample ({reason})")
    bins = pack_samples(fitting, seq_len)
    packed = [s for b in bins for s in b]
    micro_batches = [MicroBatch.pack(b) for b in bins]
    return Batch(kept, weight_step, rewards, advantages, packed, micro_batches, len(samples) - len(fitting))
