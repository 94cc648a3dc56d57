import statistics
from types import SimpleNamespace

import pytest
from rollouts import ONE_SAMPLED, build_samples, group, rollout, sampled

from orchestrator.config import AdvantageConfig
from orchestrator.verifiers_adapter.envs import trace_branches

BRANCH = sampled([1, 2, 3], 1, [-1.0, -2.0])


def node(n, sampled):
    return SimpleNamespace(mask=[sampled] * n, sampled=sampled, logprobs=[-1.0] * n if sampled else [])


def branch(nodes, trainable=True):
    ids = [i for n in nodes for i in range(len(n.mask))]
    return SimpleNamespace(
        nodes=nodes,
        trainable=trainable,
        token_ids=ids,
        logprobs=[-1.0 if m else 0.0 for n in nodes for m in n.mask],
        routed_experts=None,
    )


def test_forked_branches_train_a_shared_sampled_node_once():
    prompt, first_reply, tool, second_reply, rewritten = (
        node(5, False),
        node(3, True),
        node(2, False),
        node(4, True),
        node(6, False),
    )
    trace = SimpleNamespace(
        branches=[
            branch([prompt, first_reply, tool, second_reply]),
            branch([prompt, first_reply, rewritten, node(2, True)]),  # a non-prefix turn forked here
            branch([prompt, node(9, True)], trainable=False),
        ]
    )
    first, second = trace_branches(trace)
    assert first.loss_mask == [False] * 5 + [True] * 3 + [False] * 2 + [True] * 4
    assert second.loss_mask == [False] * 5 + [False] * 3 + [False] * 6 + [True] * 2  # first_reply already trained
    assert len(second.token_ids) == len(second.loss_mask)


def test_build_samples_group_advantages_per_prompt():
    groups = [[rollout(1.0, BRANCH), rollout(0.0, BRANCH, BRANCH)], group([0.5, 0.5], BRANCH)]
    samples, rewards, advantages = build_samples(groups, weight_step=3)
    assert advantages == [[0.5, -0.5], [0.0, 0.0]]
    assert [s.advantage for s in samples] == [0.5, -0.5, -0.5, 0.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.5, 0.5]
    assert all(s.weight_step == 3 for s in samples)
    assert statistics.fmean(reward for row in rewards for reward in row) == pytest.approx(0.5)


def test_truncation_policies_are_off_by_default():
    samples, *_ = build_samples([[rollout(1.0, BRANCH, truncated=True), rollout(0.0, BRANCH)]], weight_step=0)
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert samples[0].loss_mask == [False, True, True]


def test_zero_truncated_completions_scores_them_zero_before_advantages():
    samples, rewards, _ = build_samples(
        [[rollout(1.0, BRANCH, truncated=True), *group([0.5, 0.0], BRANCH)]], weight_step=0, zero_truncated=True
    )
    assert rewards == [[0.0, 0.5, 0.0]]
    assert [s.advantage for s in samples] == pytest.approx([-1 / 6, 1 / 3, -1 / 6])
    assert samples[0].loss_mask == [False, True, True]  # still trained, now as a bad example


def test_mask_truncated_completions_trains_none_of_their_tokens():
    truncated = [[rollout(1.0, BRANCH, truncated=True), rollout(0.0, BRANCH)]]
    samples, *_ = build_samples(truncated, weight_step=0, mask_truncated=True)
    assert samples[0].loss_mask == [False, False, False]
    assert samples[1].loss_mask == [False, True, True]
    assert [s.advantage for s in samples] == [0.5, -0.5]  # the reward still counts in the group baseline


def test_uniform_groups_are_dropped_only_when_asked_and_never_all():
    groups = [group([1.0, 0.0], ONE_SAMPLED), group([0.5, 0.5], ONE_SAMPLED)]
    assert len(build_samples(groups, 0)[0]) == 4
    kept, *_ = build_samples(groups, 0, advantage=AdvantageConfig(drop_uniform_groups=True))
    assert [s.reward for s in kept] == [1.0, 0.0]
    tied = [group([0.0, 0.0], ONE_SAMPLED)]  # every group ties: the step keeps them (it trains nothing)
    assert len(build_samples(tied, 0, advantage=AdvantageConfig(drop_uniform_groups=True))[0]) == 2


def test_failed_rollouts_give_no_sample_and_leave_the_baseline_to_the_others():
    failed = rollout(0.0, ONE_SAMPLED, ok=False, error="ValueError: boom")
    groups = [[rollout(1.0, BRANCH), failed, rollout(0.0, BRANCH)], [failed, failed, failed]]
    samples, _, advantages = build_samples(groups, weight_step=0)
    assert [s.advantage for s in samples] == [0.5, -0.5]  # mean of the two that finished is 0.5
    assert advantages == [[0.5, 0.0, -0.5], [0.0, 0.0, 0.0]]


def test_the_servers_routes_go_from_the_trace_into_the_micro_batches_and_stay_out_when_absent():
    """Each trainable branch's routes (verifiers' ``Branch.routed_experts``, from its nodes) ride with its sample into
    the micro-batch that packs it; a micro-batch with a sample the server returned none for carries none."""
    import numpy as np
    import torch
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import Branch

    from contracts.protocol import MicroBatch, repack

    def node(ids, routes, sampled=False):
        message = vf.AssistantMessage(content="a") if sampled else vf.UserMessage(content="u")
        return MessageNode(message=message, token_ids=ids, mask=[sampled] * len(ids), sampled=sampled,
                           logprobs=[-1.0 if sampled else 0.0] * len(ids), routed_experts=routes)  # fmt: skip

    prompt = node([1, 2], np.zeros((2, 2, 2), np.uint8))
    reply = node([3, 4, 5], np.full((3, 2, 2), 3, np.uint8), sampled=True)
    routed = Branch(index=0, nodes=[prompt, reply])
    unrouted = Branch(index=1, nodes=[prompt, node([6], None, sampled=True)])
    trace = SimpleNamespace(branches=[routed, unrouted, Branch(index=2, nodes=[prompt], trainable=False)])
    branches = trace_branches(trace)
    routes = [b.routes for b in branches]
    assert len(routes) == 2 and routes[1] is None
    assert routes[0].dtype == torch.uint8 and routes[0][:, 0, 0].tolist() == [0, 0, 3, 3, 3]

    rollouts = [rollout(r, *branches) for r in (0.0, 1.0)]
    samples, _, _ = build_samples([rollouts], weight_step=0)
    assert torch.equal(samples[0].routes, routes[0]) and samples[1].routes is None
    assert torch.equal(MicroBatch.pack([samples[0], samples[2]]).routes, torch.cat([routes[0], routes[0]]))
    assert MicroBatch.pack(samples[:2]).routes is None
    (repacked,) = repack([MicroBatch.pack([samples[0]]), MicroBatch.pack([samples[2]])], 64)  # the trainer's repacking
    assert torch.equal(repacked.routes, torch.cat([routes[0], routes[0]]))
    assert "routes" not in MicroBatch.pack([samples[1]]).to_dict()  # absent from the file, not an empty tensor
