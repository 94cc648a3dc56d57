"""assemble_batch: hand-built finished groups in, the exact batch out, as the disk protocol defines it
(docs/protocol.md, "A micro-batch"; contracts.protocol): samples packed end to end into rows of at most seq_len
tokens (first fit, longest first), position ids restarting per sample, the loss mask True exactly on sampled tokens,
the server's logprobs there and 0 elsewhere, each sample's group-relative advantage over its tokens."""

import copy
import dataclasses

import pytest
import torch
from rollouts import ONE_SAMPLED, rollout, sampled

from contracts.protocol import read_batch, write_batch
from contracts.sampling import Truncation
from orchestrator.batching.batch import assemble_batch, group_relative_advantages
from orchestrator.batching.rollout import Rollout
from orchestrator.config import AdvantageConfig


def tensors(micro_batch) -> dict[str, list]:
    return {name: tensor.tolist() for name, tensor in micro_batch.to_dict().items()}


A = rollout(1.0, sampled([10, 11, 12, 13], 2, [-0.5, -0.25]), task="a")
B = rollout(0.0, sampled([10, 11, 14], 2, [-1.0]), task="a")
C = rollout(3.0, sampled([20, 21, 22, 23, 24], 3, [-0.125, -2.0]), task="c")
D = rollout(1.0, sampled([20, 25], 1, [-3.0]), task="c")


def labelled(one: Rollout, steps: list[int | None]) -> Rollout:
    """``one`` with its branch's tokens labelled by the server with the weights ``steps`` that sampled them."""
    return dataclasses.replace(one, branches=[dataclasses.replace(one.branches[0], weight_steps=steps)])


def test_each_token_keeps_the_weights_step_that_sampled_it_through_the_batch_files(tmp_path):
    """Weights changed in flight: the server labelled A's two sampled tokens steps 5 and 6 and C's 6 and 6; D was
    sampled where no label came back (its group's start, 5). A sample's weight_step is its oldest sampled token's,
    its unsampled tokens carry that, and batch.json lists the steps that sampled tokens."""
    a = labelled(A, [None, None, 5, 6])
    b = labelled(B, [None, None, 6])
    c = labelled(C, [None, None, None, 6, 6])
    batch = assemble_batch(7, [[a, b], [c, D]], weight_step=5, seq_len=8)
    write_batch(tmp_path, batch.info(7, 1.0, 0.0, {}), batch.micro_batches)
    info, micro_batches = read_batch(tmp_path, 7)
    assert [m.weight_steps.tolist() for m in micro_batches] == [[6, 6, 6, 6, 6, 6, 6, 6], [5, 5, 5, 6, 5, 5]]
    assert [s["weight_step"] for s in info.samples] == [6, 6, 5, 5]  # C, B, A, D
    assert info.weight_steps == [5, 6]


def test_groups_become_packed_rows_of_exact_tokens_masks_logprobs_and_group_advantages():
    batch = assemble_batch(7, [[A, B], [C, D]], weight_step=5, seq_len=8)
    # lengths A 4, B 3, C 5, D 2; longest first: C opens row 0 (3 left), A row 1 (4 left), B fills row 0, D row 1
    assert [s.token_ids for s in batch.samples] == [r.branches[0].token_ids for r in (C, B, A, D)]
    # advantages: reward minus the group's mean, (1, 0) -> +-0.5 and (3, 1) -> +-1
    assert [s.advantage for s in batch.samples] == [1.0, -0.5, 0.5, -1.0]
    assert [tensors(m) for m in batch.micro_batches] == [
        {
            "input_ids": [20, 21, 22, 23, 24, 10, 11, 14],
            "position_ids": [0, 1, 2, 3, 4, 0, 1, 2],
            "loss_mask": [False, False, False, True, True, False, False, True],
            "advantages": [1.0] * 5 + [-0.5] * 3,
            "inference_logprobs": [0.0, 0.0, 0.0, -0.125, -2.0, 0.0, 0.0, -1.0],
            "weight_steps": [5] * 8,  # the server labelled no token: the weights the groups started on
            "sample_lengths": [5, 3],
        },
        {
            "input_ids": [10, 11, 12, 13, 20, 25],
            "position_ids": [0, 1, 2, 3, 0, 1],
            "loss_mask": [False, False, True, True, False, True],
            "advantages": [0.5] * 4 + [-1.0] * 2,
            "inference_logprobs": [0.0, 0.0, -0.5, -0.25, 0.0, -3.0],
            "weight_steps": [5] * 6,
            "sample_lengths": [4, 2],
        },
    ]
    assert batch.rewards == [[1.0, 0.0], [3.0, 1.0]] and batch.advantages == [[0.5, -0.5], [1, -1]]
    assert (batch.overlong, batch.empty, batch.failed) == (0, 0, [])
    info = batch.info(7, temperature=0.7, reward_mean=1.25, metrics={"m": 1.0})
    assert (info.step, info.num_samples, info.num_tokens, info.num_loss_tokens) == (7, 4, 14, 6)
    assert (info.weight_steps, info.temperature, info.reward_mean, info.metrics) == ([5], 0.7, 1.25, {"m": 1.0})
    # batch.json describes the samples in the rows' order
    assert [(s["task"], s["reward"], s["advantage"], s["weight_step"]) for s in info.samples] == [
        ("c", 3.0, 1.0, 5), ("a", 0.0, -0.5, 5), ("a", 1.0, 0.5, 5), ("c", 1.0, -1.0, 5)
    ]  # fmt: skip


def test_the_batch_is_what_the_trainer_reads_back(tmp_path):
    batch = assemble_batch(3, [[A, B], [C, D]], weight_step=2, seq_len=8)
    write_batch(tmp_path, batch.info(3, 1.0, 0.5, {}, Truncation(top_p=0.9, top_k=20)), batch.micro_batches)
    info, micro_batches = read_batch(tmp_path, 3, vocab_size=32)  # the trainer's checks pass
    assert [tensors(m) for m in micro_batches] == [tensors(m) for m in batch.micro_batches]
    assert info.num_loss_tokens == 6
    assert info.truncation == Truncation(top_p=0.9, top_k=20)  # the trainer replays the server's truncation


def test_the_same_groups_give_the_same_batch_and_are_left_as_they_were():
    groups = [[A, B], [C, rollout(1.0, sampled([20, 25], 1, [-3.0]), truncated=True)]]
    before = copy.deepcopy(groups)
    first = assemble_batch(0, groups, 0, seq_len=8, mask_truncated=True)
    second = assemble_batch(0, groups, 0, seq_len=8, mask_truncated=True)
    assert [tensors(m) for m in first.micro_batches] == [tensors(m) for m in second.micro_batches]
    assert groups == before  # masking the truncated rollout's sample did not touch the rollout


def test_every_branch_of_a_rollout_is_a_sample_with_the_rollouts_advantage():
    forked = rollout(1.0, sampled([1, 2, 3], 1, [-0.5, -0.5]), sampled([1, 2, 9, 4], 3, [-2.0]))
    batch = assemble_batch(0, [[forked, rollout(0.0, sampled([1, 5], 1, [-1.0]))]], 0, seq_len=16)
    assert [(s.token_ids, s.advantage, s.reward) for s in batch.samples] == [
        ([1, 2, 9, 4], 0.5, 1.0), ([1, 2, 3], 0.5, 1.0), ([1, 5], -0.5, 0.0)
    ]  # fmt: skip
    assert tensors(batch.micro_batches[0])["sample_lengths"] == [4, 3, 2]


def test_uniform_groups_are_left_out_only_with_drop_uniform_groups_and_never_all():
    tied = [rollout(1.0, sampled([7, 8], 1, [-1.0])), rollout(1.0, sampled([7, 9], 1, [-1.0]))]
    split = [A, B]
    kept = assemble_batch(0, [tied, split], 0, seq_len=16)
    assert sorted(s.token_ids[-1] for s in kept.samples) == [8, 9, 13, 14]  # tied samples train at advantage 0
    assert [s.advantage for s in kept.samples if s.token_ids[0] == 7] == [0.0, 0.0]

    drop = AdvantageConfig(drop_uniform_groups=True)
    dropped = assemble_batch(0, [tied, split], 0, seq_len=16, advantage=drop)
    assert [s.token_ids for s in dropped.samples] == [A.branches[0].token_ids, B.branches[0].token_ids]
    assert dropped.rewards == [[1.0, 1.0], [1.0, 0.0]]  # the left-out group still counts in the metrics

    all_tied = assemble_batch(0, [tied], 0, seq_len=16, advantage=drop)  # a step of ties still writes its batch
    assert [s.advantage for s in all_tied.samples] == [0.0, 0.0]


def test_failed_rollouts_give_no_sample_and_lost_groups_nothing_at_all():
    failed = rollout(0.0, ok=False, error="ValueError: boom", task="b")
    lost = [rollout(1.0, sampled([3, 4], 1, [-1.0])), rollout(0.0, ok=False, error="ToolsetError: down", lost=True)]
    batch = assemble_batch(0, [[A, failed, B], lost], 4, seq_len=16)
    assert [s.token_ids for s in batch.samples] == [A.branches[0].token_ids, B.branches[0].token_ids]
    assert [s.advantage for s in batch.samples] == [0.5, -0.5]  # the baseline is the finished rollouts' mean
    assert batch.groups == [[A, failed, B]] and batch.failed == [failed]
    assert batch.rewards == [[1.0, 0.0, 0.0]] and batch.advantages == [[0.5, 0.0, -0.5]]


def test_truncated_rollouts_are_masked_or_scored_zero_as_asked():
    cut = rollout(1.0, sampled([1, 2, 3], 1, [-1.0, -1.0]), truncated=True)
    group = [cut, rollout(0.5, sampled([1, 4], 1, [-1.0])), rollout(0.0, sampled([1, 5], 1, [-1.0]))]

    masked = assemble_batch(0, [group], 0, seq_len=16, mask_truncated=True)
    assert masked.samples[0].loss_mask == [False, False, False] and masked.empty == 1
    assert tensors(masked.micro_batches[0])["loss_mask"] == [False] * 3 + [False, True] * 2
    assert [s.advantage for s in masked.samples] == [0.5, 0.0, -0.5]  # its reward still counts in the baseline

    zeroed = assemble_batch(0, [group], 0, seq_len=16, zero_truncated=True)
    assert zeroed.rewards == [[0.0, 0.5, 0.0]]
    assert [s.advantage for s in zeroed.samples] == pytest.approx([-1 / 6, 1 / 3, -1 / 6])
    assert zeroed.samples[0].loss_mask == [False, True, True]  # still trained, as a bad example


def test_samples_longer_than_seq_len_are_left_out_and_counted():
    long = rollout(1.0, sampled([1, 2, 3, 4, 5], 1, [-1.0] * 4))
    batch = assemble_batch(0, [[long, B], [C, D]], 0, seq_len=4)
    assert batch.overlong == 2  # long and C
    assert [s.token_ids for s in batch.samples] == [B.branches[0].token_ids, [20, 25]]
    assert all(len(m.input_ids) <= 4 for m in batch.micro_batches) and len(batch.micro_batches) == 2


def test_seats_of_a_task_each_have_their_own_baseline_unless_baseline_groups_is_task():
    # two episodes of a zero-sum game: player0 won the first, player1 the second; a fixed opponent played too
    def seat(reward: float, name: str, last: int) -> Rollout:
        return rollout(reward, sampled([1, 2, last], 2, [-1.0]), seat=name, task="t")

    p0 = [seat(1.0, "player0", 10), seat(-1.0, "player0", 11)]
    p1 = [seat(-1.0, "player1", 12), seat(1.0, "player1", 13)]
    fixed = [rollout(5.0, seat="judge", trained=False, task="t"), rollout(-5.0, seat="judge", trained=False, task="t")]
    group = [p0[0], p1[0], fixed[0], p0[1], p1[1], fixed[1]]
    by_seat = assemble_batch(0, [group], 0, seq_len=16)
    advantages = {s.token_ids[-1]: (s.meta["seat"], s.advantage) for s in by_seat.samples}
    assert advantages == {10: ("player0", 1.0), 11: ("player0", -1.0), 12: ("player1", -1.0), 13: ("player1", 1.0)}
    assert by_seat.advantages == [[1.0, -1.0, 0.0, -1.0, 1.0, 0.0]]  # the untrained seat: no sample, 0

    # one baseline over the task: the trained seats' mean is 0, so each keeps its reward; the judge's 5s stay out
    by_task = assemble_batch(0, [group], 0, seq_len=16, advantage=AdvantageConfig(baseline_groups="task"))
    assert by_task.advantages == [[1.0, -1.0, 0.0, -1.0, 1.0, 0.0]]
    shifted = [seat(1.0, "player0", 10), seat(0.0, "player1", 12), seat(1.0, "player0", 11), seat(0.0, "player1", 13)]
    assert assemble_batch(0, [shifted], 0, seq_len=16).advantages == [[0.0] * 4]
    task_wide = assemble_batch(0, [shifted], 0, seq_len=16, advantage=AdvantageConfig(baseline_groups="task"))
    assert task_wide.advantages == [[0.5, -0.5, 0.5, -0.5]]


def test_a_group_is_uniform_when_each_of_its_seats_tied():
    drop = AdvantageConfig(drop_uniform_groups=True)
    won = [rollout(r, ONE_SAMPLED, seat=seat) for r, seat in [(1.0, "a"), (-1.0, "b"), (1.0, "a"), (-1.0, "b")]]
    batch = assemble_batch(0, [won, [A, B, A, B]], 0, seq_len=16, advantage=drop)
    assert sorted(s.token_ids[-1] for s in batch.samples) == [13, 13, 14, 14]  # player a always won: left out
    task_wide = drop.model_copy(update={"baseline_groups": "task"})
    assert len(assemble_batch(0, [won, [A, B, A, B]], 0, seq_len=16, advantage=task_wide).samples) == 8


def test_environments_whose_groups_hold_different_numbers_of_rollouts_share_a_batch():
    solo = [rollout(r, ONE_SAMPLED, env="solo") for r in (1.0, 0.0)]
    duel = [rollout(r, ONE_SAMPLED, env="duel", seat=seat) for r, seat in [(1.0, "a"), (-1.0, "b")] * 2]
    batch = assemble_batch(3, [solo, duel], 0, seq_len=16)
    assert batch.rewards == [[1.0, 0.0], [1.0, -1.0, 1.0, -1.0]]
    assert batch.advantages == [[0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]  # each seat of the duel against its own mean
    assert len(batch.samples) == 6


def test_each_sample_names_its_rollout_in_its_meta():
    """batch.json's per-sample summary (contracts.protocol.sample_summary) reads these keys."""
    named = rollout(1.0, ONE_SAMPLED, env="math", task="t1", seat="player0", rewards={"correct": 1.0},
                    metrics={"steps": 2.0}, truncated=True, turns=3)  # fmt: skip
    batch = assemble_batch(0, [[named, rollout(0.0, ONE_SAMPLED)]], 0, seq_len=16)
    assert batch.samples[0].meta == {"env": "math", "task": "t1", "seat": "player0", "rewards": {"correct": 1.0},
                                     "metrics": {"steps": 2.0}, "truncated": True, "turns": 3}  # fmt: skip


def test_a_failed_rollout_gives_no_sample_even_with_the_branches_it_made_before_failing():
    failed = rollout(1.0, ONE_SAMPLED, ok=False, error="ValueError: boom")
    batch = assemble_batch(0, [[failed, A, B]], 0, seq_len=16)
    assert [s.token_ids for s in batch.samples] == [A.branches[0].token_ids, B.branches[0].token_ids]


def test_integer_rewards_give_the_advantages_float_ones_do():
    """Rewards annotated float may be ints (a reward function returning 1 or 0)."""
    as_ints = assemble_batch(0, [[rollout(1, ONE_SAMPLED), rollout(0, ONE_SAMPLED)]], 0, seq_len=16)
    assert as_ints.advantages == [[0.5, -0.5]]


def test_a_sample_with_no_sampled_token_carries_its_groups_weights_step():
    prompt_only = rollout(1.0, sampled([1, 2], 2, []))
    batch = assemble_batch(0, [[prompt_only, A]], weight_step=3, seq_len=16)
    empty = next(s for s in batch.samples if not any(s.loss_mask))
    assert empty.weight_step == 3 and empty.weight_steps == [3, 3]


def test_a_sample_of_exactly_seq_len_tokens_is_trained_and_the_batch_keeps_its_weights_step():
    batch = assemble_batch(0, [[A, B]], weight_step=5, seq_len=4)  # A: 4 tokens
    assert batch.overlong == 0 and [s.token_ids for s in batch.samples] == [A.branches[0].token_ids, [10, 11, 14]]
    assert batch.weight_step == 5


def test_a_branchs_routes_and_images_reach_its_sample():
    routes, images = torch.zeros(2, 1, 2, dtype=torch.uint8), ["a" * 64]
    routed = rollout(1.0, sampled([1, 2], 1, [-1.0], routes=routes, images=images))
    sample = assemble_batch(0, [[routed, rollout(0.0, ONE_SAMPLED)]], 0, seq_len=16).samples[0]
    assert sample.routes is routes and sample.images == images


def test_weight_step_labels_that_do_not_line_up_with_the_tokens_are_refused():
    """The server labels each token with the weights step that sampled it: a label too many or too few is refused,
    never cut to fit (the too-many one would otherwise fit the sample's other fields and pass unseen)."""
    for steps in ([None, None, 5, 6, 6], [None, None, 5]):
        with pytest.raises(ValueError):
            assemble_batch(7, [[labelled(A, steps), B]], weight_step=5, seq_len=8)


def test_group_relative_advantages_refuse_rewards_that_are_not_one_row_per_group():
    for rewards in ([[1.0, 0.0]], [[1.0, 0.0], [3.0, 1.0], [0.0, 0.0]]):
        with pytest.raises(ValueError):
            group_relative_advantages([[A, B], [C, D]], rewards, AdvantageConfig())


def test_a_masked_rollout_trains_no_token_by_cross_entropy_either():
    """Under mask_truncated a truncated rollout's cross-entropy weights go with its loss mask; unmasked, they stay."""
    cut = rollout(1.0, sampled([1, 2, 3], 1, [-1.0, -1.0], ce_weights=[0.0, 1.0, 0.5]), truncated=True)
    for mask_truncated, weights in ((True, None), (False, [0.0, 1.0, 0.5])):
        batch = assemble_batch(0, [[cut, rollout(0.0, ONE_SAMPLED)]], 0, seq_len=16, mask_truncated=mask_truncated)
        assert batch.samples[0].ce_weights == weights and any(batch.samples[0].loss_mask) is not mask_truncated
