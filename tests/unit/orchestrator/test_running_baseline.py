"""[advantage] baseline = "running" (RAE): a running baseline per environment and seat across steps, saved in the
orchestrator's checkpoint so that a resumed run computes the advantages an uninterrupted one does."""

import asyncio
import json

import pytest
from resumed_runs import run_steps
from rollouts import ONE_SAMPLED, build_samples, rollout

import orchestrator.loop.groups as groups_module
from contracts.metrics import read_metrics
from contracts.run_dir import rollouts_dir
from orchestrator.batching.running_baseline import RunningBaselines
from orchestrator.config import AdvantageConfig, OrchestratorConfig
from orchestrator.loop.ckpt import Checkpointer, read_state

RUNNING = AdvantageConfig(baseline="running", running_decay=0.5)


def duel(reward0: float, env: str = "duel") -> list:
    """One episode of a zero-sum game: player0 gets ``reward0``, player1 its negation."""
    return [
        rollout(reward0, ONE_SAMPLED, env=env, seat="player0"),
        rollout(-reward0, ONE_SAMPLED, env=env, seat="player1"),
    ]


def test_each_seat_is_scored_against_its_own_running_average_before_its_reward_moves_it():
    running = RunningBaselines(decay=0.5)
    # step 1: two episodes; player0 wins, then loses
    advantages = build_samples([duel(1.0), duel(-1.0)], 0, advantage=RUNNING, running=running)[2]
    # player0: 1 - 0 = 1, b = 0.5; then -1 - 0.5 = -1.5, b = 0.25 - 0.5 = -0.25
    # player1: -1 - 0 = -1, b = -0.5; then 1 + 0.5 = 1.5, b = -0.25 + 0.5 = 0.25
    assert advantages == [[1.0, -1.0], [-1.5, 1.5]]
    assert running.baselines == {("duel", "player0"): -0.25, ("duel", "player1"): 0.25}
    # step 2: the baselines carry over; another environment's seats have their own (from 0); a failed rollout and an
    # untrained seat get 0 and move nothing
    other = duel(1.0, env="other")
    failed = rollout(5.0, ok=False, env="duel", seat="player0")
    untrained = rollout(5.0, env="duel", seat="player1", trained=False)
    advantages = build_samples([duel(1.0), other, [failed, untrained]], 0, advantage=RUNNING, running=running)[2]
    assert advantages == [[1.25, -1.25], [1.0, -1.0], [0.0, 0.0]]
    assert running.baselines == {("duel", "player0"): 0.375, ("duel", "player1"): -0.375,
                                 ("other", "player0"): 0.5, ("other", "player1"): -0.5}  # fmt: skip


def test_a_tied_group_still_has_advantages_and_truncated_rollouts_score_zero_when_asked():
    running = RunningBaselines(decay=0.5)
    tied = [rollout(1.0, ONE_SAMPLED, seat="agent"), rollout(1.0, ONE_SAMPLED, seat="agent", truncated=True)]
    samples, rewards, advantages = build_samples([tied], 0, advantage=RUNNING, running=running, zero_truncated=True)
    assert rewards == [[1.0, 0.0]] and advantages == [[1.0, -0.5]]  # 1 - 0; then 0 - 0.5
    assert [s.advantage for s in samples] == [1.0, -0.5]


def test_save_then_load_gives_the_advantages_of_an_uninterrupted_run(tmp_path):
    steps = [[duel(1.0), duel(1.0)], [duel(-1.0)], [duel(1.0), duel(-1.0)], [duel(1.0)]]
    whole = RunningBaselines(decay=0.5)
    expected = [build_samples(groups, 0, advantage=RUNNING, running=whole)[2] for groups in steps]

    stopped = RunningBaselines(decay=0.5)
    for groups in steps[:2]:
        build_samples(groups, 0, advantage=RUNNING, running=stopped)
    Checkpointer(tmp_path, [stopped]).save(2)
    assert read_state(tmp_path, 2)["running_baselines"] == [
        {"env": "duel", "seat": "player0", "baseline": -0.125}, {"env": "duel", "seat": "player1", "baseline": 0.125}
    ]  # fmt: skip
    resumed = RunningBaselines(decay=0.5)
    Checkpointer(tmp_path, [resumed]).load(2)
    got = [build_samples(groups, 0, advantage=RUNNING, running=resumed)[2] for groups in steps[2:]]
    assert got == expected[2:]
    assert got[0] != build_samples(steps[2], 0, advantage=RUNNING, running=RunningBaselines(decay=0.5))[2]


def test_a_checkpoint_without_running_baselines_starts_them_at_zero(tmp_path, caplog):
    running = RunningBaselines(decay=0.5)
    running.load_state_dict({"step": 3})
    assert running.baselines == {} and "has no running baselines" in caplog.text


def test_a_resumed_orchestrator_writes_the_advantages_of_an_uninterrupted_one(tmp_path, monkeypatch, on_weights_server):
    """Whole orchestrators, one rollout per example (a running baseline needs no group), resumed after step 3."""
    steps = 5

    async def run_group(env, task, n, ctx, limits, output_dir):
        won = 1.0 if int(task.data.id.split("-")[-1]) % 3 == 0 else -1.0
        return [rollout(won * sign, ONE_SAMPLED, env="duel", seat=seat, task=task.data.id)
                for sign, seat in ((1, "player0"), (-1, "player1"))]  # fmt: skip

    monkeypatch.setattr(groups_module, "run_group", run_group)

    def build(output_dir, resume_step=None):
        config = OrchestratorConfig(
            output_dir=output_dir, env=[{"id": "char-target", "args": {"num_examples": 30}}], batch_size=4,
            rollouts_per_example=1, max_steps=steps, async_level=1, sample_rollouts_every=0,
            advantage={"baseline": "running", "running_decay": 0.5},
            ckpt={"interval": 1, "keep": None, "resume_step": resume_step},
        )  # fmt: skip
        return on_weights_server(config)[0]

    def advantages(output_dir, step):
        batch = json.loads((rollouts_dir(output_dir, step) / "batch.json").read_text())
        return [(s["task"], s["seat"], s["reward"], s["advantage"]) for s in batch["samples"]]

    asyncio.run(run_steps(build(tmp_path / "whole"), steps))
    asyncio.run(run_steps(build(tmp_path / "stopped"), steps, stop_at=3))
    assert (
        read_state(tmp_path / "stopped", 3)["running_baselines"]
        == read_state(tmp_path / "whole", 3)["running_baselines"]
    )
    asyncio.run(run_steps(build(tmp_path / "stopped", resume_step=-1), steps))
    for step in range(4, steps + 1):
        assert advantages(tmp_path / "stopped", step) == advantages(tmp_path / "whole", step), step
    saved = read_state(tmp_path / "stopped", steps)["running_baselines"]
    logged = read_metrics(tmp_path / "stopped", "orchestrator")[-1]  # the last step's, after the resume
    assert {k: v for k, v in logged.items() if k.startswith("running_baseline/")} == {
        f"running_baseline/{entry['env']}/{entry['seat']}": entry["baseline"] for entry in saved
    } and len(saved) == 2
    # the baselines the restore gave matter: not one of step 4's advantages is the bare reward
    assert all(advantage != reward for _, _, reward, advantage in advantages(tmp_path / "whole", 4))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"baseline": "running", "drop_uniform_groups": True}, "drop_uniform_groups = true with baseline = 'running'"),
        ({"baseline": "running", "mean_normalize": True}, "mean_normalize = true with baseline = 'running'"),
        (
            {"baseline": "running", "baseline_groups": "episode_seat"},
            "baseline_groups = 'episode_seat' with baseline = 'running'",
        ),
    ],
)
def test_a_running_baseline_refuses_what_needs_a_group(settings, message):
    with pytest.raises(ValueError, match=message):
        AdvantageConfig(**settings)


def test_one_rollout_per_example_is_refused_but_for_a_running_baseline_and_refill_needs_a_group_baseline():
    env = [{"id": "char-target"}]
    with pytest.raises(ValueError, match="rollouts_per_example = 1 with advantage.baseline = 'mean'"):
        OrchestratorConfig(env=env, rollouts_per_example=1)
    assert (
        OrchestratorConfig(env=env, rollouts_per_example=1, advantage={"baseline": "running"}).rollouts_per_example == 1
    )
    with pytest.raises(ValueError, match="filter.refill = true with advantage.baseline = 'running'"):
        OrchestratorConfig(env=env, advantage={"baseline": "running"}, filter={"refill": True})
