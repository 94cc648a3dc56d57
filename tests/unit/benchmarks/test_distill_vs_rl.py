"""The distillation-against-RL benchmark's summary of its runs (the runs themselves need two servers: a report, run
by hand, not in CI)."""

import pytest


def run(setting: str, rewards: list[float]) -> dict:
    return {"setting": setting, "rewards": rewards, "reward_gain": rewards[-1] - rewards[0],
            "reward_mean": sum(rewards) / len(rewards)}  # fmt: skip


def test_each_side_averages_its_own_runs_step_by_step(benchmarks):
    compare = benchmarks("distill_vs_rl").compare
    runs = [run("rl", [0.1, 0.2]), run("opd", [0.2, 0.6]), run("opd", [0.4, 0.8]), run("rl", [0.3, 0.2])]

    result = compare(runs)

    assert result["rl"]["runs"] == result["opd"]["runs"] == 2
    assert result["rl"]["reward_per_step"] == pytest.approx([0.2, 0.2])
    assert result["opd"]["reward_per_step"] == pytest.approx([0.3, 0.7])
    assert result["opd"]["reward_gain"] == pytest.approx({"mean": 0.4, "min": 0.4, "max": 0.4})
    assert result["rl"]["reward_gain"] == pytest.approx({"mean": 0.0, "min": -0.1, "max": 0.1})
    assert result["rl"]["reward_mean"] == pytest.approx({"mean": 0.2, "min": 0.15, "max": 0.25})
    assert result["opd_minus_rl_reward_mean"] == pytest.approx(0.5 - 0.2)
