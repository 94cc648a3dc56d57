"""Several agents per rollout: every seat a verifiers environment opens is a rollout of the run, tagged with its seat.
environments/digit_duel (two seats of the policy, zero-sum) runs through run_group against the fake policy, whose
every reply is "hi"; each seat's trace becomes one rollout whose loss mask covers its own replies exactly, an untrained
seat's none, and the batch holds only the trained seats' samples, each with its seat."""

import pytest
from fake_policy import FakePolicy, PolicyHandler, rollouts_of, serving
from transformers import AutoTokenizer

from contracts.errors import TridentError
from contracts.model_path import TINY_MODEL_ID
from orchestrator.batching.batch import assemble_batch
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.tiny_model import built_model_path

EPISODES = 2


class ModelsHandler(PolicyHandler):
    """Replies "hi", recording the model each request names."""

    def do_POST(self) -> None:
        self.server.models.append(self.read_json()["model"])
        self.respond(200, self.server.hi)


def duel(models: list[str] | None = None, **args):
    """The rollouts of ``EPISODES`` episodes of digit-duel with ``args`` as its own config; ``models`` gets the
    model each request named."""
    server = FakePolicy(ModelsHandler)
    server.models = models if models is not None else []
    with serving(server):
        return rollouts_of("digit-duel", server.base_url, EPISODES, RolloutLimits.of(EPISODES), env_args=args)


def test_each_seat_of_a_two_seat_game_is_a_rollout_whose_mask_covers_its_own_replies_exactly():
    hi = AutoTokenizer.from_pretrained(built_model_path(TINY_MODEL_ID)).encode("hi<|im_end|>", add_special_tokens=False)
    rollouts = duel(rounds=2)
    assert [r.seat for r in rollouts] == ["player0", "player1"] * EPISODES
    for rollout in rollouts:
        assert rollout.ok and rollout.trained and rollout.turns == 2, rollout.error
        assert rollout.rewards == {"win": 0.0} and rollout.reward == 0.0  # both wrote no digit: a tie
        branch, *more = rollout.branches
        ids, mask, logprobs = branch.token_ids, branch.loss_mask, branch.logprobs
        assert more == []  # each turn's prompt extends the last: one sample per seat
        assert [i for i, m in zip(ids, mask, strict=True) if m] == hi * 2  # its two replies, nothing else
        assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == [-1.0] * len(hi) * 2
    first, second = rollouts[:2]
    # player1 was opened by player0's reply: its prompt holds "hi" as the user's word, which it does not train on
    # player0's prompt holds the task's prompt too
    assert len(second.branches[0].token_ids) < len(first.branches[0].token_ids)
    batch = assemble_batch(1, [rollouts], 0, seq_len=4096)
    assert sorted(s.meta["seat"] for s in batch.samples) == ["player0", "player0", "player1", "player1"]


def test_a_seat_the_environment_does_not_train_gives_no_sample():
    rollouts = duel(rounds=1, train_player1=False)
    assert [(r.seat, r.trained) for r in rollouts] == [("player0", True), ("player1", False)] * EPISODES
    assert all(r.ok and r.turns == 1 for r in rollouts)
    assert [r.branches == [] for r in rollouts] == [False, True] * EPISODES
    batch = assemble_batch(1, [rollouts], 0, seq_len=4096)
    assert [s.meta["seat"] for s in batch.samples] == ["player0"] * EPISODES


def test_a_seat_pinned_to_another_model_is_sampled_from_it_and_never_trained():
    models = []
    rollouts = duel(models, rounds=1, player1={"model": "someone-else"})
    assert sorted(models) == ["someone-else"] * EPISODES + [TINY_MODEL_ID] * EPISODES
    assert [(r.seat, r.trained, r.ok) for r in rollouts] == [("player0", True, True), ("player1", False, True)] * 2
    assert [r.branches == [] for r in rollouts] == [False, True] * EPISODES


def test_the_environments_own_config_is_checked_in_one_line_naming_the_key():
    with pytest.raises(TridentError, match=r"^environment 'digit-duel' rejects its args: env_args.roundz: Extra"):
        duel(roundz=1)
