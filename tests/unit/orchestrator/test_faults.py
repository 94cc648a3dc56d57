"""Faults of an environment stay faults of its rollouts: a task whose setup raises, an episode with no trace, a
rollout that raises, a model call refused as unauthorized; a step where every rollout failed stops the run with one
line naming the environment, and a step that trains names its rollouts that trained nothing."""

import asyncio
import json
import logging
import re
import sys

import httpx
import pytest
import verifiers.v1 as vf
from fake_policy import FakePolicy, PolicyHandler, rollouts_of, serving
from rollouts import group, sampled

import orchestrator.loop.groups as groups_module
from contracts.errors import TridentError
from contracts.metrics import read_metrics
from contracts.run_dir import rollouts_dir
from orchestrator.batching.batch import assemble_batch
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.loop.run import Orchestrator
from orchestrator.metrics.stats import rollout_metrics
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group, to_rollouts
from orchestrator.verifiers_adapter.harness import InProcessHarness
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.tiny_model import built_model_path

# verifiers imports an environment by id: this module is the `trident-test-faults` environment.
ENV_ID = "trident-test-faults"
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])
UNREACHABLE = "http://127.0.0.1:9"  # no model call is made: every fault here comes before one


class FaultConfig(vf.TasksetConfig):
    broken_tasks: list[str] = ["t0", "t1"]
    setup_s: float = 0.0


class FaultData(vf.TaskData):
    broken: bool
    setup_s: float = 0.0


class FaultTask(vf.Task[FaultData, vf.State, vf.TaskConfig]):
    set_up = 0  # set-ups that ran to their end

    async def setup(self, trace: vf.Trace, runtime) -> None:
        await asyncio.sleep(self.data.setup_s)
        FaultTask.set_up += 1
        if self.data.broken:
            raise RuntimeError("the task's data volume is not mounted")

    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class FaultTaskset(vf.Taskset[FaultTask, FaultConfig]):
    def load(self):
        for i in range(2):
            broken = f"t{i}" in self.config.broken_tasks
            data = FaultData(id=f"t{i}", prompt="Say hi.", broken=broken, setup_s=self.config.setup_s)
            yield FaultTask(data, self.config.task)


__all__ = ["InProcessHarness", "FaultTaskset"]


def test_a_task_whose_setup_raises_gives_failed_rollouts_with_its_error():
    env = load_env(EnvConfig(id=ENV_ID))
    ctx = model_context(OrchestratorConfig(client={"base_url": UNREACHABLE}), built_model_path("trident/tiny-qwen3"))
    task = next(iter(env.taskset.load()))

    async def run():
        async with env.serving():
            return await run_group(env, task, 3, ctx, RolloutLimits.of(3))

    rollouts = asyncio.run(run())
    assert [r.ok for r in rollouts] == [False] * 3
    assert all(
        r.error == "TaskError: task setup: RuntimeError: the task's data volume is not mounted" for r in rollouts
    )
    assert all(r.env == ENV_ID and r.task == "t0" and r.branches == [] for r in rollouts)


def test_a_rollout_past_its_timeout_is_a_failed_rollout():
    env = load_env(EnvConfig(id=ENV_ID, args={"setup_s": 30.0}, timeout_s=0.5))
    ctx = model_context(OrchestratorConfig(client={"base_url": UNREACHABLE}), built_model_path("trident/tiny-qwen3"))
    task = next(iter(env.taskset.load()))

    async def run():
        async with env.serving():
            rollouts = await run_group(env, task, 2, ctx, RolloutLimits.of(2))
            return rollouts, FaultTask.set_up

    FaultTask.set_up = 0
    rollouts, set_up = asyncio.run(run())
    assert set_up == 0  # the group ended before either 30 s set-up did: both were cut off
    assert all(not r.ok and "timed out" in r.error.lower() for r in rollouts), [r.error for r in rollouts]


def test_an_episode_without_a_trace_is_a_failed_rollout():
    data = FaultData(id="t7", prompt="Say hi.", broken=False)
    empty = vf.Episode(task=vf.TraceTask(type="FaultTask", data=data), traces=[])
    (rollout,) = to_rollouts(empty, ENV_ID, ["agent"], "m")
    assert rollout.ok is False and (rollout.task, rollout.seat) == ("t7", "agent")
    assert rollout.error == "the environment returned no trace of seat 'agent'"
    errors, seats = [vf.Error(type="EnvError", message="FaultEnv.setup(): no sandbox left")], ["player0", "player1"]
    failed = to_rollouts(vf.Episode(task=vf.TraceTask(type="FaultTask", data=data), traces=[], errors=errors), ENV_ID,
                         seats, "m")  # fmt: skip
    assert [(r.seat, r.ok, r.error) for r in failed] == [(s, False, "EnvError: FaultEnv.setup(): no sandbox left")
                                                         for s in seats]  # fmt: skip


def test_a_rollout_that_raises_is_a_failed_rollout(monkeypatch):
    env = load_env(EnvConfig(id=ENV_ID))

    async def raising_run_slot(slot, ctx):
        raise KeyError("trace")

    monkeypatch.setattr(env, "run_slot", raising_run_slot)
    task = next(iter(env.taskset.load()))
    (rollout,) = asyncio.run(run_group(env, task, 1, None, RolloutLimits.of(1)))
    assert not rollout.ok and rollout.error == "KeyError: 'trace'" and rollout.env == ENV_ID
    assert 'raise KeyError("trace")' in rollout.traceback and rollout.traceback.endswith("KeyError: 'trace'\n")


def orchestrator(tmp_path, broken_tasks: list[str], batch_size: int = 1) -> Orchestrator:
    config = OrchestratorConfig(
        output_dir=tmp_path,
        env=[{"id": ENV_ID, "args": {"broken_tasks": broken_tasks}}],
        batch_size=batch_size,
        rollouts_per_example=2,
        sample_rollouts_every=0,
        client={"base_url": UNREACHABLE},
    )
    orch = Orchestrator(config)
    served = {"step": 0, "path": "/base", "adapter": None}
    orch.servers.servers[0].client.http = httpx.AsyncClient(
        base_url="http://server", transport=httpx.MockTransport(lambda request: httpx.Response(200, json=served))
    )
    return orch


def test_a_step_where_every_rollout_failed_stops_with_one_line_naming_the_environment_and_keeps_them(tmp_path):
    with pytest.raises(TridentError) as error:
        asyncio.run(orchestrator(tmp_path, broken_tasks=["t0", "t1"]).step(1))
    setup_error = "TaskError: task setup: RuntimeError: the task's data volume is not mounted"
    assert re.fullmatch(
        rf"step 1: no rollout produced a training sample: 2 failed \({setup_error} ×2, first in environment "
        rf"'{ENV_ID}' \(task t[01]\)\); each failed rollout's full error is in the run's metrics/failed_rollouts.jsonl",
        str(error.value),
    )
    kept = read_metrics(tmp_path, "failed_rollouts")  # written although the step stopped the run
    assert [(r["step"], r["env"], r["seat"], r["error"], r["lost"]) for r in kept] == [
        (1, ENV_ID, "agent", setup_error, False)
    ] * 2 and len({r["task"] for r in kept}) == 1  # one task, two rollouts
    for record in kept:  # with the traceback verifiers recorded: the task's line that raised, in its setup()
        assert 'raise RuntimeError("the task\'s data volume is not mounted")' in record["traceback"]


class Unauthorized(PolicyHandler):
    """Refuses every model call as the interception server refuses a request it cannot place."""

    def do_POST(self) -> None:
        self.read_json()
        self.respond(401, {"error": "unauthorized"})


def test_model_calls_refused_as_unauthorized_are_failed_rollouts_named_in_the_steps_error():
    with serving(FakePolicy(Unauthorized)) as server:
        rollouts = rollouts_of(ENV_ID, server.base_url, 2, RolloutLimits.of(2), args={"broken_tasks": []})
    unauthorized = 'ProviderError: Error code: 401 - {"error": "unauthorized"}'
    assert [(r.ok, r.lost, r.error) for r in rollouts] == [(False, False, unauthorized)] * 2  # not retried: a 4xx
    with pytest.raises(TridentError) as error:
        assemble_batch(1, [rollouts], 0, seq_len=1024)
    assert str(error.value) == (
        f"step 1: no rollout produced a training sample: 2 failed ({unauthorized} ×2, first in environment "
        f"'{ENV_ID}' (task t0)); each failed rollout's full error is in the run's metrics/failed_rollouts.jsonl"
    )
    assert rollout_metrics([rollouts], [[0.0, 0.0]], 1.0)["failed/ProviderError"] == 2


def test_a_step_with_some_failed_rollouts_trains_on_the_others_and_logs_the_error(tmp_path, caplog, monkeypatch):
    orch = orchestrator(tmp_path, broken_tasks=["t1"], batch_size=2)  # both tasks: t0 works, t1 fails in setup

    async def sample_without_server(env, task, n, ctx, limit, output_dir):  # t0's rollouts, as if the model answered
        if task.data.broken:
            return await run_group(env, task, n, ctx, limit)
        return group(range(n), sampled([1, 2, 3], 1, [-0.5, -0.5]), env=ENV_ID, task="t0")

    monkeypatch.setattr(groups_module, "run_group", sample_without_server)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        asyncio.run(orch.step(1))
    info = json.loads((rollouts_dir(tmp_path, 1) / "batch.json").read_text())
    assert info["num_samples"] == 2 and info["metrics"]["failed_rollouts"] == info["metrics"]["failed/TaskError"] == 2
    assert f"step 1: 2 rollouts failed in environment '{ENV_ID}': TaskError: task setup" in caplog.text


def test_a_step_that_trains_logs_and_counts_the_rollouts_that_trained_nothing(tmp_path, caplog, monkeypatch):
    orch = orchestrator(tmp_path, broken_tasks=[], batch_size=2)

    async def one_task_samples_nothing(
        env, task, n, ctx, limit, output_dir
    ):  # t1's rollouts finish without a model call
        if task.data.id == "t1":
            return group([0.0] * n, env=ENV_ID, task="t1")
        return group(range(n), sampled([1, 2, 3], 1, [-0.5, -0.5]), env=ENV_ID, task="t0")

    monkeypatch.setattr(groups_module, "run_group", one_task_samples_nothing)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        asyncio.run(orch.step(1))
    info = json.loads((rollouts_dir(tmp_path, 1) / "batch.json").read_text())
    assert info["num_samples"] == 2 and info["metrics"]["no_sample/no_trainable_token"] == 2
    assert info["metrics"]["no_sample/too_long"] == 0 and info["metrics"]["failed_rollouts"] == 0
    assert "step 1: 2 rollouts trained nothing: 2 with no trainable token (2 made no model call)" in caplog.text
