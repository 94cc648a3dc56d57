"""[eval]: scores of held-out tasks at step 0, every interval and on the final weights, each on the weights it is
logged under."""

import asyncio
from pathlib import Path

import pytest
from rollouts import ONE_SAMPLED, group, rollout
from wandb_runs import finished_runs

import orchestrator.loop.groups as groups_module
from contracts.config import ConfigError, parse_config
from contracts.metrics import read_metrics
from contracts.progress import read_progress
from contracts.run_dir import mark_stable, weights_dir
from contracts.shared_config import WandbConfig
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.evaluation import eval_scores


def test_eval_scores_pass_at_k_and_avg_at_k():
    groups = [
        group([1.0, 0.0, 0.0, 0.0], ONE_SAMPLED),  # one of four passes
        group([0.0, 0.2, 0.0, 0.0], ONE_SAMPLED),  # none
        # a failed one: no score, no pass
        group([1.0, 1.0], ONE_SAMPLED) + [rollout(1.0, ONE_SAMPLED, ok=False), rollout(0.5, ONE_SAMPLED)],
    ]
    scores = eval_scores("env", groups, pass_reward=0.9)
    assert scores["eval/env/pass@4"] == pytest.approx(2 / 3)
    assert scores["eval/env/avg@4"] == pytest.approx((1 / 4 + 0 + 2 / 4) / 3)
    assert scores["eval/env/reward_mean"] == pytest.approx((1.0 + 0.2 + 2.0 + 0.5) / 12)
    assert scores["eval/env/failed"] == 1


def test_eval_scores_each_seat_of_a_multi_agent_environment_over_its_own_rollouts():
    def episode(proposer: float, *solvers: float) -> list:
        return [rollout(proposer, seat="proposer"), *(rollout(reward, seat="solver") for reward in solvers)]

    groups = [episode(1.0, 1.0, 0.0) + episode(0.0, 0.0, 0.0), episode(0.0, 0.0, 0.0) + episode(0.0, 0.0, 0.0)]
    scores = eval_scores("ps", groups, pass_reward=0.9)
    assert scores["eval/ps/proposer/pass@2"] == 0.5 and scores["eval/ps/proposer/avg@2"] == 0.25
    assert scores["eval/ps/solver/pass@4"] == 0.5 and scores["eval/ps/solver/avg@4"] == 0.125
    assert scores["eval/ps/solver/reward_mean"] == 0.125 and scores["eval/ps/pass@6"] == 0.5
    assert not any("/agent/" in key for key in eval_scores("one", [group([1.0, 0.0], ONE_SAMPLED)], 0.9))


def test_eval_needs_an_env_table_and_no_eval_turns_a_files_eval_off():
    with pytest.raises(ConfigError, match="eval.env"):
        parse_config(OrchestratorConfig, ["--eval.interval", "5"])
    debug = ["@", str(Path(__file__).parents[3] / "configs" / "debug" / "rl" / "orch.toml")]
    assert parse_config(OrchestratorConfig, debug).eval.env[0].args == {"seed": 1}
    assert parse_config(OrchestratorConfig, [*debug, "--no-eval"]).eval is None


def test_evaluations_run_at_step_0_every_interval_and_on_the_final_weights_each_on_its_weights(
    tmp_path, monkeypatch, on_weights_server
):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = OrchestratorConfig(
        output_dir=tmp_path, batch_size=1, rollouts_per_example=2, sample_rollouts_every=0, max_steps=4,
        env=[{"id": "char-target"}],
        eval={"env": [{"id": "char-target", "args": {"seed": 1}}], "interval": 2, "num_examples": 3,
              "rollouts_per_example": 2, "pass_reward": 2.0},
        wandb=WandbConfig(name="run", offline=True),  # the scores go to W&B too, against their own step
    )  # fmt: skip
    orchestrator, server = on_weights_server(config)
    assert len(orchestrator.evaluation.sets[0].tasks) == 3

    async def run_group(env, task, n, ctx, limit, output_dir):
        # each rollout scores the weights step it sampled from, at its start and at its end: an evaluation that a
        # reload overtook would log rewards of two steps
        first = server.step
        if env is orchestrator.evaluation.sets[0].env:  # the console is told what runs and how far it got
            shown = [a for a in read_progress(tmp_path) if a.text == f"evaluating weights step {first}"]
            assert len(shown) == 1 and shown[0].total == 3 and shown[0].process == "orchestrator"
        await asyncio.sleep(0.05 if n == 2 and env is orchestrator.evaluation.sets[0].env else 0)
        return [rollout(float(first + server.step) / 2, ONE_SAMPLED) for _ in range(n)]

    monkeypatch.setattr(groups_module, "run_group", run_group)

    async def run():
        for step in range(1, config.max_steps + 1):
            for weights in range(1, step):  # the trainer keeps up
                if not weights_dir(tmp_path, weights).exists():
                    weights_dir(tmp_path, weights).mkdir(parents=True)
                    mark_stable(weights_dir(tmp_path, weights))
            await orchestrator.step(step)
        final = weights_dir(tmp_path, config.max_steps)
        final.mkdir(parents=True)
        mark_stable(final)
        await orchestrator.evaluate_final_weights()
        orchestrator.metrics.close()

    asyncio.run(run())
    assert read_progress(tmp_path) == []  # every step and evaluation ended
    evals = read_metrics(tmp_path, "eval")
    assert [e["step"] for e in evals] == [0, 2, 4]  # step 0, each interval reached, the final weights
    for record in evals:  # every rollout of an evaluation sampled from the weights it is logged under
        assert record["eval/char-target/reward_mean"] == record["step"]
        assert record["eval/char-target/pass@2"] == (record["step"] >= 2)
        assert record["eval/seconds"] > 0
    assert len(read_metrics(tmp_path, "orchestrator")) == config.max_steps  # training's records are apart
    (data,) = finished_runs(tmp_path)
    assert all(key.encode() in data for key in ("eval/char-target/pass@2", "eval/step"))
