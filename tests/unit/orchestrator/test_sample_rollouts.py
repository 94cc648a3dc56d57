from rollouts import rollout, sampled

from orchestrator.batching.rollout import Rollout
from orchestrator.metrics.sample_rollouts import MAX_CHARS, prompt_and_completion, sample_rows, shorten


def decode(token_ids: list[int]) -> str:
    return " ".join(map(str, token_ids))


def test_prompt_and_completion_of_a_split_rollout_show_the_conversation_as_it_ended():
    first = sampled([1, 2, 3, 4], 2, [0.0, 0.0])
    second = sampled([1, 2, 3, 4, 5, 6], 5, [0.0])  # the first sample, a tool turn, more
    assert prompt_and_completion(rollout(0.0, first, second)) == ([1, 2], [3, 4, 5, 6])
    rewritten = sampled([1, 9, 5, 6], 3, [0.0])  # a history rewrite that dropped the prompt: not shown
    assert prompt_and_completion(rollout(0.0, first, rewritten)) == ([1, 2], [3, 4])
    assert prompt_and_completion(rollout(0.0)) == ([], [])  # a failed rollout without tokens


def test_sample_rows_show_the_first_group_of_each_environment():
    sample = sampled([7, 8, 9], 1, [0.0, 0.0])

    def scored(reward: float, env: str, **fields) -> Rollout:  # a reward function's score and a judge's verdict
        return rollout(reward, sample, env=env, rewards={"correct": reward, "judge": float(reward > 0.5)}, **fields)

    groups = [
        [scored(1.0, "math", seat="player0"), scored(0.0, "math", truncated=True, seat="player1")],
        [scored(0.5, "math"), scored(0.5, "math")],  # a second group of math: not shown
        [scored(0.25, "code"), scored(0.0, "code")],
    ]
    rewards = [[1.0, 0.0], [0.5, 0.5], [0.25, 0.0]]
    advantages = [[0.5, -0.5], [0.0, 0.0], [0.125, -0.125]]
    rows = sample_rows(4, groups, rewards, advantages, decode)
    assert [(r["env"], r["seat"], r["reward"], r["truncated"]) for r in rows] == [
        ("math", "player0", 1.0, False),
        ("math", "player1", 0.0, True),
        ("code", "", 0.25, False),
        ("code", "", 0.0, False),
    ]
    assert rows[0] == {
        "step": 4,
        "env": "math",
        "task": "",
        "seat": "player0",
        "prompt": "7",
        "completion": "8 9",
        "reward": 1.0,
        "rewards": {"correct": 1.0, "judge": 1.0},
        "advantage": 0.5,
        "truncated": False,
    }
    assert rows[2]["advantage"] == 0.125
    assert [r["rewards"]["judge"] for r in rows] == [1.0, 0.0, 0.0, 0.0]  # the judge's verdicts, yes and no


def test_shorten_keeps_start_and_end():
    assert shorten("short") == "short"
    text = "a" * MAX_CHARS + "b" * MAX_CHARS
    cut = shorten(text)
    assert cut.startswith("a" * (MAX_CHARS // 2) + " […] ") and cut.endswith("b" * (MAX_CHARS // 2))
    assert len(cut) <= MAX_CHARS + 5
