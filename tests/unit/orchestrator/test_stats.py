import pytest
from rollouts import build_samples, masked, rollout

from orchestrator.batching.rollout import Rollout
from orchestrator.metrics.stats import advantage_metrics, describe, env_metrics, rollout_metrics, split_lengths


def step_groups() -> list[list[Rollout]]:
    return [
        [
            rollout(1.0, masked("..sss"), rewards={"correct": 1.0, "format": 0.5}, turns=1),
            # two turns whose second prompt rewrote the first: two samples
            rollout(0.0, masked("..s."), masked("....ss"), truncated=True, rewards={"correct": 0.0}, turns=2),
        ],
        [
            rollout(0.5, masked(".s"), ok=False, error="HarnessError: the agent exited with 1", turns=1),
            rollout(0.5, masked("..."), turns=1),  # nothing trainable: all prompt
        ],
    ]


def test_rollout_metrics_on_hand_made_rollouts():
    groups = step_groups()
    rewards = [[1.0, 0.0], [0.5, 0.5]]
    metrics = rollout_metrics(groups, rewards, generate_s=2.0)
    assert metrics == pytest.approx(
        {
            "reward_mean": 0.5,
            "reward_std": (0.5 / 3) ** 0.5,  # unbiased, over the 4 rollouts
            "reward/correct": 0.5,  # over the rollouts it scored
            "reward/format": 0.5,
            "uniform_groups": 0.5,
            "truncated_rate": 0.25,
            "failed_rollouts": 1,
            "failed/HarnessError": 1,
            "turns_mean": 1.25,
            "sampled_tokens": 7,
            "rollouts_per_s": 2.0,
            "sampled_tokens_per_s": 3.5,
            # per sample: lengths 5, 4, 6, 2, 3; prompts 2, 2, 4, 1, 3; completions 3, 2, 2, 1, 0
            "sequence_len_mean": 4.0,
            "sequence_len_max": 6,
            "prompt_len_mean": 2.4,
            "prompt_len_max": 4,
            "completion_len_mean": 1.6,
            "completion_len_max": 3,
        }
    )


def test_the_reward_is_the_trained_seats_an_untrained_seats_is_left_out():
    groups = [[rollout(1.0, masked(".s"), seat="assistant"), rollout(0.0, seat="user", trained=False)]] * 2
    metrics = rollout_metrics(groups, [[1.0, 0.0], [1.0, 0.0]], generate_s=1.0)
    assert (metrics["reward_mean"], metrics["reward_std"]) == (1.0, 0.0)


def test_each_seat_has_its_reward_and_trained_tokens_an_untrained_seats_reward_included():
    def episode(proposer: float, *solvers: float) -> list[Rollout]:
        return [rollout(proposer, seat="proposer", trained=False, env="ps"),
                *(rollout(reward, masked("..ss"), seat="solver", env="ps") for reward in solvers)]  # fmt: skip

    groups = [episode(1.0, 1.0, 0.0) + episode(0.0, 1.0, 1.0), episode(0.0, 0.0, 0.0) + episode(0.0, 0.0, 0.0)]
    rewards = [[r.reward for r in group] for group in groups]
    metrics = rollout_metrics(groups, rewards, generate_s=1.0)
    assert {key: value for key, value in metrics.items() if key.startswith("seat/")} == pytest.approx(
        {
            "seat/proposer/reward_mean": 0.25,
            "seat/proposer/reward_std": 0.5,
            "seat/proposer/sampled_tokens": 0,  # untrained: its rollouts give no trainable token
            "seat/solver/reward_mean": 0.375,
            "seat/solver/reward_std": (0.375 * 0.625 * 8 / 7) ** 0.5,
            "seat/solver/sampled_tokens": 16,
        }
    )
    assert metrics["reward_mean"] == 0.375  # the trained seats' alone
    assert env_metrics(groups, rewards, generate_s=1.0)["env/ps/seat/proposer/reward_mean"] == 0.25


def test_env_metrics_are_each_environments_rollout_metrics():
    groups = step_groups()
    for done in groups[0]:
        done.env = "math"
    for done in groups[1]:
        done.env = "chat"
    rewards = [[1.0, 0.0], [0.5, 0.5]]
    metrics = env_metrics(groups, rewards, generate_s=2.0)
    assert metrics["env/math/reward_mean"] == 0.5 and metrics["env/chat/reward_mean"] == 0.5
    assert metrics["env/math/reward/correct"] == 0.5 and "env/chat/reward/correct" not in metrics
    assert metrics["env/math/failed_rollouts"] == 0 and metrics["env/chat/failed_rollouts"] == 1
    assert metrics["env/chat/failed/HarnessError"] == 1 and "env/math/failed/HarnessError" not in metrics
    assert metrics["env/math/truncated_rate"] == 0.5 and metrics["env/chat/uniform_groups"] == 1.0
    assert not any(name.endswith("_per_s") for name in metrics)


def test_advantage_metrics_are_over_the_samples_the_trainer_gets():
    groups = step_groups()
    samples, _, advantages = build_samples(groups, weight_step=0)
    assert advantages == [[0.5, -0.5], [0.0, 0.0]]
    # rollout 1 gave two samples: its advantage counts twice; the failed rollout gave none
    assert [s.advantage for s in samples] == [0.5, -0.5, -0.5, 0.0]
    metrics = advantage_metrics(samples)
    assert metrics == pytest.approx(
        {"advantage_mean": -0.125, "advantage_std": 0.47871, "advantage_min": -0.5, "advantage_max": 0.5}, abs=1e-5
    )


def test_describe_and_split_lengths_edge_cases():
    assert describe("x", []) == {}
    assert describe("x", [3.0]) == {"x_mean": 3.0, "x_std": 0.0, "x_min": 3.0, "x_max": 3.0}
    assert describe("x", [1, 3], ("max",)) == {"x_max": 3}
    assert split_lengths([False, False, True, False, True]) == (2, 3)  # the tool token after a reply is completion
    assert split_lengths([False, False]) == (2, 0)
    assert split_lengths([]) == (0, 0)
