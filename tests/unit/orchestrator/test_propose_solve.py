"""A proposer and its solvers in one episode: environments/propose_solve through run_group against a scripted fake
policy, which writes the problem "2 + 3" when asked for one and answers the solvers "5" and "7" in turn. Each seat's
trace is a rollout whose mask covers exactly its own reply; the solver seat, played ``solvers`` times an episode,
gives that many rollouts; baselines are per task × seat, so the solvers' rewards never share one with the
proposer's; the proposer's reward is highest when half the solvers solve its problem."""

import itertools

import pytest
from fake_policy import FakePolicy, PolicyHandler, rollouts_of, serving
from propose_solve import balance
from rollouts import build_samples
from transformers import AutoTokenizer

from contracts.model_path import TINY_MODEL_ID
from orchestrator.batching.batch import assemble_batch
from orchestrator.config import AdvantageConfig
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.tiny_model import built_model_path

EPISODES = 2
TOKENIZER = AutoTokenizer.from_pretrained(built_model_path(TINY_MODEL_ID))


def tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedPolicy(FakePolicy):
    """Writes ``problem`` when asked for a problem, else answers "5" and "7" in turn; records each prompt."""

    def __init__(self, problem: str):
        super().__init__(ScriptedHandler)
        self.problem, self.answers, self.prompts = problem, itertools.cycle(["5", "7"]), []

    def reply(self, text: str) -> dict:
        ids = tokens(f"{text}<|im_end|>")
        logprobs = [{"token": f"token_id:{token}", "logprob": -1.0} for token in ids]
        return {"request_id": text, "choices": [{"index": 0, "token_ids": ids, "logprobs": {"content": logprobs},
                                                 "finish_reason": "stop"}]}  # fmt: skip


class ScriptedHandler(PolicyHandler):
    server: ScriptedPolicy

    def do_POST(self) -> None:
        prompt = TOKENIZER.decode(self.read_json()["token_ids"])
        self.server.prompts.append(prompt)
        proposing = "addition problem" in prompt
        self.respond(200, self.server.reply(self.server.problem if proposing else next(self.server.answers)))


def episodes(problem: str = "2 + 3", **args):
    """The rollouts of ``EPISODES`` episodes of propose-solve (one at a time: the answers alternate within each), and
    the prompts the policy saw."""
    server = ScriptedPolicy(problem)
    with serving(server):
        rollouts = rollouts_of("propose-solve", server.base_url, EPISODES, RolloutLimits.of(1), env_args=args)
    return rollouts, server.prompts


def trained_ids(rollout) -> list[int]:
    (branch,) = rollout.branches
    return [i for i, m in zip(branch.token_ids, branch.loss_mask, strict=True) if m]


def test_each_solver_run_is_a_rollout_of_the_solver_seat_and_the_proposer_is_rewarded_for_a_split():
    rollouts, prompts = episodes(solvers=2)
    assert [r.seat for r in rollouts] == ["proposer", "solver", "solver"] * EPISODES
    assert all(r.ok and r.trained and r.turns == 1 for r in rollouts), [r.error for r in rollouts]
    assert sum("What is 2 + 3?" in p for p in prompts) == 2 * EPISODES  # each solver got the proposer's problem
    for proposer, first, second in zip(*[iter(rollouts)] * 3, strict=True):
        assert trained_ids(proposer) == tokens("2 + 3<|im_end|>")  # its reply, not the task's prompt
        assert (trained_ids(first), trained_ids(second)) == (tokens("5<|im_end|>"), tokens("7<|im_end|>"))
        assert (first.rewards, second.rewards) == ({"correct": 1.0}, {"correct": 0.0})
        assert proposer.rewards == {"balance": 1.0} and proposer.metrics == {"solved": 0.5, "valid_problem": 1.0}
    batch = assemble_batch(1, [rollouts], 0, seq_len=4096)
    advantages = {s.meta["seat"]: [] for s in batch.samples}
    for sample in batch.samples:
        advantages[sample.meta["seat"]].append(sample.advantage)
    # per task × seat: the proposers' rewards (all 1) against their own mean, the solvers' (1, 0) against theirs
    assert sorted(advantages["proposer"]) == [0.0] * EPISODES
    assert sorted(advantages["solver"]) == [-0.5] * EPISODES + [0.5] * EPISODES
    pooled = assemble_batch(1, [rollouts], 0, seq_len=4096, advantage=AdvantageConfig(baseline_groups="task"))
    assert [s.advantage for s in pooled.samples if s.meta["seat"] == "proposer"] == pytest.approx([1 / 3] * EPISODES)
    # episode_seat: the solvers of one problem against their own mean; task_seat: all solvers of the task against one
    assert [r.episode for r in rollouts] == [0, 0, 0, 1, 1, 1]
    rollouts[4].reward = 0.0  # episode 1's solvers: (0, 0), tied within their episode
    per_problem = build_samples([rollouts], 0, advantage=AdvantageConfig(baseline_groups="episode_seat"))[2]
    assert per_problem == [[0.0, 0.5, -0.5, 0.0, 0.0, 0.0]]  # the proposers, once an episode, still per task × seat
    assert build_samples([rollouts], 0)[2] == [[0.0, 0.75, -0.25, 0.0, -0.25, -0.25]]


def test_an_untrained_proposer_keeps_its_reward_and_gives_no_sample():
    rollouts, _ = episodes(solvers=1, train_proposer=False)
    assert [(r.seat, r.trained) for r in rollouts] == [("proposer", False), ("solver", True)] * EPISODES
    assert [r.branches == [] for r in rollouts] == [True, False] * EPISODES
    assert [r.rewards for r in rollouts if r.seat == "proposer"] == [{"balance": 0.0}] * EPISODES  # all solved
    batch = assemble_batch(1, [rollouts], 0, seq_len=4096)
    assert [s.meta["seat"] for s in batch.samples] == ["solver"] * EPISODES


def test_a_reply_without_a_problem_scores_the_proposer_zero_and_leaves_the_solvers_the_tasks_example():
    rollouts, prompts = episodes(problem="no idea", solvers=2)
    example = prompts[0].split("like ")[1].split(", with")[0]
    assert sum(f"What is {example}?" in p for p in prompts) == 2 * EPISODES
    assert [r.rewards for r in rollouts if r.seat == "proposer"] == [{"balance": 0.0}] * EPISODES
    assert [r.metrics["valid_problem"] for r in rollouts if r.seat == "proposer"] == [0.0] * EPISODES


def test_the_proposers_reward_is_highest_when_half_the_solvers_solve():
    assert [balance(share) for share in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0.0, 0.5, 1.0, 0.5, 0.0]
