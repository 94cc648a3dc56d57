import torch

from orchestrator.envs import Rollout
from orchestrator.sample_rollouts import MAX_CHARS, prompt_and_completion, sample_rows, shorten


def decode(token_ids: list[int]) -> str:
    return " ".join(map(str, token_ids))


def rollout(env: str, reward: float, *branches: tuple[list[int], list[bool]], truncated: bool = False) -> Rollout:
    scores = {"correct": reward, "judge": float(reward > 0.5)}  # a reward function's score and a judge's verdict
    return Rollout(reward, [(ids, mask, [0.0] * len(ids)) for ids, mask in branches], ok=True, truncated=truncated,
                   env=env, rewards=scores)  # fmt: skip


def test_prompt_and_completion_of_a_split_rollout_show_the_conversation_as_it_ended():
    first = ([1, 2, 3, 4], [False, False, True, True])
    second = ([1, 2, 3, 4, 5, 6], [False, False, False, False, False, True])  # the first sample, a tool turn, more
    assert prompt_and_completion(rollout("e", 0.0, first, second)) == ([1, 2], [3, 4, 5, 6])
    rewritten = ([1, 9, 5, 6], [False, False, False, True])  # a history rewrite that dropped the prompt: not shown
    assert prompt_and_completion(rollout("e", 0.0, first, rewritten)) == ([1, 2], [3, 4])
    assert prompt_and_completion(rollout("e", 0.0)) == ([], [])  # a failed rollout without tokens


def test_sample_rows_show_the_first_group_of_each_environment():
    sample = ([7, 8, 9], [False, True, True])
    groups = [
        [rollout("math", 1.0, sample), rollout("math", 0.0, sample, truncated=True)],
        [rollout("math", 0.5, sample), rollout("math", 0.5, sample)],  # a second group of math: not shown
        [rollout("code", 0.25, sample), rollout("code", 0.0, sample)],
    ]
    rewards = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.25, 0.0]])
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    rows = sample_rows(4, groups, rewards, advantages, decode)
    assert [(r["env"], r["reward"], r["truncated"]) for r in rows] == [
        ("math", 1.0, False),
        ("math", 0.0, True),
        ("code", 0.25, False),
        ("code", 0.0, False),
    ]
    assert rows[0] == {
        "step": 4,
        "env": "math",
        "task": "",
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
