"""A step's training batch, assembled from its finished groups by a pure function: no server, no disk, the same
batch for the same groups. What it holds is the disk protocol's (docs/protocol.md, :mod:`contracts.protocol`).
"""

from collections import Counter
from dataclasses import dataclass

import torch

from contracts.errors import TridentError
from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_samples, sample_summary
from contracts.sampling import NO_TRUNCATION, Truncation
from orchestrator.batching.advantage import baseline_groups, group_advantages, group_rewards, uniform_baselines
from orchestrator.batching.distill import distill_advantages, distilled, loss_token_mean
from orchestrator.batching.infra import is_lost
from orchestrator.batching.no_sample import Untrained, no_sample_error, untrained_reason
from orchestrator.batching.rollout import Branch, Rollout
from orchestrator.batching.running_baseline import RunningBaselines
from orchestrator.batching.teacher_samples import cross_entropy_only
from orchestrator.config import AdvantageConfig


def rollout_samples(
    groups: list[list[Rollout]],
    weight_step: int,
    mask_truncated: bool = False,
    zero_truncated: bool = False,
    advantage: AdvantageConfig | None = None,
    running: RunningBaselines | None = None,
    distill_coef: float = 1.0,
) -> tuple[list[list[list[Sample] | None]], list[list[float]], list[list[float]]]:
    """The training samples of each rollout of ``groups`` (None for the rollouts of a group left out for tying),
    with group-relative advantages; also the rewards and advantages they were built from, one row per group (groups
    of different environments may hold different numbers of rollouts).

    ``zero_truncated`` scores rollouts cut off by max_tokens 0; ``mask_truncated`` trains none of their tokens.
    Rollouts share a baseline as ``advantage.baseline_groups`` says
    (:func:`~orchestrator.batching.advantage.baseline_groups`: by default those of one task and one seat). Failed
    rollouts (the environment raised) give no sample, and the baseline they would have shared is the others'. Under
    ``baseline = "running"`` the advantages are ``running``'s (which it moves past these groups) instead.

    A distilled rollout (its branches carry the teacher's logprobs: :mod:`~orchestrator.batching.distill`) trains
    each token on its own advantage, ``distill_coef * (teacher - sampled logprob)``, in place of the group's; its
    row holds their mean over its sampled tokens, and its group is never dropped for tying. Nor is a group with
    cross-entropy weights (ECHO's, a teacher's samples'); a rollout of the teacher's samples gets advantage 0.
    """
    rewards = [group_rewards(group, zero_truncated) for group in groups]
    advantage = advantage or AdvantageConfig()
    if advantage.baseline == "running":
        assert running is not None, "baseline = 'running' needs the run's RunningBaselines"
        advantages = running.advantages(groups, rewards)
    else:
        advantages = group_relative_advantages(groups, rewards, advantage)
    dropped = [
        advantage.drop_uniform_groups
        and not any(distilled(r) or any(b.ce_weights for b in r.branches) for r in group)
        and uniform_baselines(group, row, advantage.baseline_groups)
        for group, row in zip(groups, rewards, strict=True)
    ]
    if all(dropped):  # keep a step whose groups all tie: it trains nothing, but the run goes on
        dropped = [False] * len(groups)
    samples: list[list[list[Sample] | None]] = []
    for group, rewards_row, advantages_row, drop in zip(groups, rewards, advantages, dropped, strict=True):
        samples_row: list[list[Sample] | None] = []
        for j, rollout in enumerate(group):
            token_advantages = None  # a distilled rollout's, per branch: its row's mean and its samples'
            if rollout.ok and distilled(rollout):
                token_advantages = [distill_advantages(b, distill_coef) for b in rollout.branches]
                mask = [m for b in rollout.branches for m in b.loss_mask]
                advantages_row[j] = loss_token_mean([a for t in token_advantages for a in t], mask)
            elif rollout.ok and cross_entropy_only(rollout):  # the teacher's sample: no policy-gradient term
                advantages_row[j] = 0.0
            samples_row.append(None if drop else _samples_of(rollout, rewards_row[j], advantages_row[j], weight_step,
                                                             mask_truncated, token_advantages))  # fmt: skip
        samples.append(samples_row)
    return samples, rewards, advantages


def group_relative_advantages(
    groups: list[list[Rollout]], rewards: list[list[float]], advantage: AdvantageConfig
) -> list[list[float]]:
    """Each rollout's advantage against the ok rollouts it shares a baseline with (0 for the others)."""
    advantages = [[0.0] * len(group) for group in groups]
    for group, row, advantages_row in zip(groups, rewards, advantages, strict=True):
        for members in baseline_groups(group, advantage.baseline_groups):
            if ok := [j for j in members if group[j].ok]:
                shared = torch.tensor([[row[j] for j in ok]], dtype=torch.float32)
                for j, value in zip(ok, group_advantages(shared, advantage)[0].tolist(), strict=True):
                    advantages_row[j] = value
    return advantages


def _samples_of(rollout: Rollout, reward: float, advantage: float, weight_step: int, mask_truncated: bool,
                token_advantages: list[list[float]] | None):  # fmt: skip
    """A sample of each branch of ``rollout`` (:func:`branch_sample`): none for a failed one; all masked when
    truncated under ``mask_truncated``. ``token_advantages``: a distilled rollout's, per branch. Its meta names its
    algorithm unless that is ``grpo`` (a GRPO batch is the batch of before, byte for byte)."""
    meta = {"env": rollout.env, "task": rollout.task, "seat": rollout.seat, "rewards": rollout.rewards,
            "metrics": rollout.metrics, "truncated": rollout.truncated, "turns": rollout.turns}  # fmt: skip
    if rollout.algorithm != "grpo":  # batch.json says so: the loss-mask checker reads it
        meta["algorithm"] = rollout.algorithm
    masked = mask_truncated and rollout.truncated
    branches = rollout.branches if rollout.ok else []
    return [
        branch_sample(branch, advantage, reward, weight_step, meta, masked, token_advantages and token_advantages[i])
        for i, branch in enumerate(branches)
    ]


def branch_sample(
    branch: Branch,
    advantage: float,
    reward: float,
    weight_step: int,
    meta: dict,
    masked: bool,
    token_advantages: list[float] | None,
) -> Sample:
    """The training sample of ``branch``, its loss mask all False (and no cross-entropy weight) when ``masked``.
    ``weight_step``: the weights served when its group started, the step of each token the server did not label
    (:attr:`Branch.weight_steps`, refused where they do not line up with its tokens); the sample's step is its oldest
    sampled token's, which its unsampled tokens carry. A distilled branch's per-token advantages
    (:func:`~orchestrator.batching.distill.distill_advantages`, None for others) are the sample's, ``advantage``
    their mean over its sampled tokens; one with cross-entropy weights gets their ``ce_roles`` in its meta."""
    labelled = branch.weight_steps or [None] * len(branch.token_ids)
    known = [weight_step if step is None else step for step in labelled]
    steps = list(zip(known, branch.loss_mask, strict=True))  # each token's weights step, and whether it is sampled
    oldest = min((step for step, m in steps if m), default=weight_step)
    if token_advantages is not None:
        advantage = loss_token_mean(token_advantages, branch.loss_mask)
    if branch.ce_roles is not None:  # batch.json says which turns its cross-entropy weights may cover
        meta = {**meta, "ce_roles": branch.ce_roles}
    return Sample(
        token_ids=branch.token_ids,
        loss_mask=[False] * len(branch.loss_mask) if masked else branch.loss_mask,
        inference_logprobs=branch.logprobs,
        advantage=advantage,
        reward=reward,
        weight_step=oldest,
        meta=meta,
        routes=branch.routes,
        weight_steps=[step if m else oldest for step, m in steps],
        images=branch.images,
        token_advantages=token_advantages,
        ce_weights=None if masked else branch.ce_weights,
    )


def token_steps(samples: list[Sample]) -> Counter[int]:
    """How many sampled tokens of ``samples`` each weights step sampled."""
    return Counter(step for s in samples for step, m in zip(s.weight_steps, s.loss_mask, strict=True) if m)


def flat(per_rollout: list[list[list[Sample] | None]]) -> list[Sample]:
    """:func:`rollout_samples`' samples in one list, group by group, rollout by rollout."""
    return [s for row in per_rollout for samples in row for s in samples or []]


@dataclass
class Batch:
    """A step's batch as the trainer reads it, and what it was built from."""

    groups: list[list[Rollout]]  # the groups that count: those not lost to infrastructure errors
    weight_step: int  # the weights served when the groups started
    rewards: list[list[float]]  # of ``groups``, one row each, as advantages saw them
    advantages: list[list[float]]
    samples: list[Sample]  # in the order the micro-batches hold them
    micro_batches: list[MicroBatch]
    overlong: int  # samples left out for being longer than seq_len
    untrained: list[Untrained]  # the step's rollouts that gave no trainable token, lost groups' included

    @property
    def failed(self) -> list[Rollout]:
        """The rollouts of ``groups`` that failed (the environment raised): they gave no sample."""
        return [r for group in self.groups for r in group if not r.ok]

    @property
    def empty(self) -> int:
        """Samples with no trainable token."""
        return sum(not any(s.loss_mask) for s in self.samples)

    def info(
        self,
        step: int,
        temperature: float,
        reward_mean: float,
        metrics: dict[str, float],
        truncation: Truncation = NO_TRUNCATION,
    ) -> BatchInfo:
        """``batch.json`` of this batch as the batch of ``step``, sampled at ``temperature`` under ``truncation``."""
        return BatchInfo(
            step=step,
            num_samples=len(self.samples),
            num_tokens=sum(len(s.token_ids) for s in self.samples),
            num_loss_tokens=sum(sum(s.loss_mask) for s in self.samples),
            num_ce_tokens=sum(m.ce_tokens() for m in self.micro_batches),
            reward_mean=reward_mean,
            temperature=temperature,
            truncation=truncation,
            weight_steps=sorted(token_steps(self.samples)) or [self.weight_step],
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
    running: RunningBaselines | None = None,
    distill_coef: float = 1.0,
) -> Batch:
    """The batch of step ``step`` from its finished groups (sampled from weights ``weight_step``).

    Groups lost to infrastructure errors are left out; the others give :func:`rollout_samples`' samples, those
    longer than ``seq_len`` tokens left out, packed into micro-batches of at most ``seq_len`` tokens (first fit,
    longest first). A :class:`TridentError` naming why (:func:`~orchestrator.batching.no_sample.no_sample_error`)
    when no trained rollout gives a trainable token. ``running``: the run's running baselines, under
    ``baseline = "running"``.
    """
    kept = [group for group in groups if not is_lost(group)]
    per_rollout, rewards, advantages = rollout_samples(
        kept, weight_step, mask_truncated, zero_truncated, advantage, running, distill_coef
    )
    untrained = [Untrained("lost", r) for group in groups if is_lost(group) for r in group if r.trained]
    for group, row in zip(kept, per_rollout, strict=True):
        for rollout, its_samples in zip(group, row, strict=True):
            if rollout.trained and (reason := untrained_reason(rollout, its_samples, seq_len)):
                untrained.append(Untrained(reason, rollout))
    if len(untrained) == sum(r.trained for group in groups for r in group):  # an untrained seat trains nothing
        raise TridentError(no_sample_error(step, untrained, seq_len))
    samples = flat(per_rollout)
    fitting = [s for s in samples if len(s.token_ids) <= seq_len]
    bins = pack_samples(fitting, seq_len)
    packed = [s for b in bins for s in b]
    micro_batches = [MicroBatch.pack(b) for b in bins]
    overlong = len(samples) - len(fitting)
    return Batch(kept, weight_step, rewards, advantages, packed, micro_batches, overlong, untrained)
