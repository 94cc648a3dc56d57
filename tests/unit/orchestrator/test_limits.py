"""The orchestrator's limits and retries, against real verifiers environments and a fake inference server that
counts what is in flight: set-ups at once (a slow task set-up), model calls on each server, and a per-rollout MCP
tool server that crashes on start (retried; lost past the retries, and the step fails past the bound)."""

import asyncio
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

import flaky_tools
import httpx
import pytest
import verifiers.v1 as vf
from fake_policy import FakePolicy, PolicyHandler, serving

from contracts.errors import TridentError
from contracts.inference_api import GENERATE
from contracts.metrics import read_metrics
from contracts.model_path import TINY_MODEL_ID, resolve_model_path
from contracts.run_dir import rollouts_dir
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.envs import Rollout, load_env, model_context, run_group
from orchestrator.infra import check_lost
from orchestrator.limits import RolloutLimits, limit_generation
from orchestrator.orchestrator import Orchestrator

ENV_ID = "trident-test-limits"  # this module is the environment of this id
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])


class SlowSetupData(vf.TaskData):
    setup_s: float = 0.3


class SlowSetupTask(vf.Task[SlowSetupData, vf.State, vf.TaskConfig]):
    setting_up = peak = 0  # set-ups running now, and the most at once

    async def setup(self, trace: vf.Trace, runtime) -> None:
        cls = SlowSetupTask
        cls.setting_up += 1
        cls.peak = max(cls.peak, cls.setting_up)
        await asyncio.sleep(self.data.setup_s)
        cls.setting_up -= 1

    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class SlowSetupTaskset(vf.Taskset[SlowSetupTask, vf.TasksetConfig]):
    def load(self):
        yield SlowSetupTask(SlowSetupData(id="t0", prompt="Say hi."), self.config.task)


__all__ = ["SlowSetupTaskset"]


class CountingServer(FakePolicy):
    """Answers ``/inference/v1/generate`` with "hi" after ``delay_s``, counting the requests in flight."""

    def __init__(self, delay_s: float):
        super().__init__(CountingHandler)
        self.delay_s, self.in_flight, self.peak, self.lock = delay_s, 0, 0, threading.Lock()


class CountingHandler(PolicyHandler):
    server: CountingServer

    def do_POST(self) -> None:
        self.read_json()
        assert self.path == GENERATE, self.path
        with self.server.lock:
            self.server.in_flight += 1
            self.server.peak = max(self.server.peak, self.server.in_flight)
        time.sleep(self.server.delay_s)
        with self.server.lock:
            self.server.in_flight -= 1
        self.respond(200, self.server.hi)


def counting_server(delay_s: float = 0.0) -> AbstractContextManager[CountingServer]:
    return serving(CountingServer(delay_s))


def rollouts_of(env_id: str, url: str, n: int, limits: RolloutLimits, **env):
    env = load_env(EnvConfig(id=env_id, **env))
    ctx = model_context(OrchestratorConfig(client={"base_url": url}), resolve_model_path(TINY_MODEL_ID))

    async def run():
        async with env.serving():
            return await run_group(env, next(iter(env.taskset.load())), n, ctx, limits)

    return asyncio.run(run())


def test_set_ups_past_the_limit_wait_for_a_slot_and_their_time_is_measured():
    SlowSetupTask.peak = 0
    with counting_server() as server:
        rollouts = rollouts_of(ENV_ID, server.base_url, 6, RolloutLimits.of(rollouts=6, setups=2))
    assert SlowSetupTask.peak == 2
    assert all(r.ok for r in rollouts), [r.error for r in rollouts]
    assert all(0.3 <= r.setup_s < 2.0 for r in rollouts)  # its own set-up, not the wait for a slot


def test_model_calls_per_server_are_limited_not_the_rollouts():
    with counting_server(delay_s=0.3) as server:
        limit_generation([server.base_url], 2)
        try:
            rollouts = rollouts_of(ENV_ID, server.base_url, 6, RolloutLimits.of(rollouts=6, setups=6))
        finally:
            limit_generation([], 1)
    assert all(r.ok for r in rollouts) and server.peak == 2


@pytest.fixture
def flaky_tools_starts(tmp_path, monkeypatch) -> Path:
    """The folder where each start of flaky_tools' server is counted; set ``FLAKY_TOOLS_FAILS`` to make it crash."""
    monkeypatch.setenv("PYTHONPATH", str(Path(flaky_tools.__file__).parent))
    monkeypatch.setenv("FLAKY_TOOLS_DIR", str(tmp_path))
    return tmp_path


def flaky_tools_step(output_dir: Path, rollouts: int, infra: dict) -> None:
    """Step 0 of an orchestrator on one flaky-tools task (``rollouts`` rollouts, ``infra`` as given), its model
    calls answered by a counting server and its weight routes from memory."""
    with counting_server() as server:
        config = OrchestratorConfig(
            output_dir=output_dir, env=[{"id": flaky_tools.ENV_ID}], batch_size=1, rollouts_per_example=rollouts,
            sample_rollouts_every=0, client={"base_url": server.base_url}, infra=infra,
        )  # fmt: skip
        orchestrator = Orchestrator(config)
        served = {"step": 0, "path": "/base", "adapter": None}
        orchestrator.servers.servers[0].client.http = httpx.AsyncClient(
            base_url=server.base_url, transport=httpx.MockTransport(lambda request: httpx.Response(200, json=served))
        )

        async def step():
            async with orchestrator.envs[0].serving():
                await orchestrator.step(1)

        asyncio.run(step())


def test_a_tool_server_that_crashes_on_its_first_start_is_retried(flaky_tools_starts, monkeypatch):
    monkeypatch.setenv("FLAKY_TOOLS_FAILS", "1")
    with counting_server() as server:
        limits = RolloutLimits.of(rollouts=1, setup_timeout_s=60, max_retries=2, backoff_s=0.01)
        (rollout,) = rollouts_of(flaky_tools.ENV_ID, server.base_url, 1, limits)
    assert rollout.ok and rollout.retries == 1 and not rollout.lost, rollout.error
    assert len(list(flaky_tools_starts.iterdir())) == 2


def test_a_tool_server_that_always_crashes_loses_its_group_naming_its_exit(flaky_tools_starts, monkeypatch):
    monkeypatch.setenv("FLAKY_TOOLS_FAILS", "99")
    with counting_server() as server:
        # noticed as it exits: verifiers would poll the dead server for 180 s, and the set-up would time out
        limits = RolloutLimits.of(rollouts=2, setup_timeout_s=600, max_retries=1, backoff_s=0.01)
        rollouts = rollouts_of(flaky_tools.ENV_ID, server.base_url, 2, limits)
    assert all(r.lost and r.retries == 1 for r in rollouts)
    assert {r.error for r in rollouts} == {
        "ToolsetError: tool server exited with code 1 during set-up: flaky_tools: crashed on start"
    }
    assert len(list(flaky_tools_starts.iterdir())) == 4  # 2 rollouts × (1 start + 1 retry)


def test_a_tool_server_that_never_starts_loses_its_group_and_past_the_bound_the_step(flaky_tools_starts, monkeypatch):
    monkeypatch.setenv("FLAKY_TOOLS_HANG", "1")
    with pytest.raises(TridentError) as error:
        flaky_tools_step(flaky_tools_starts / "run", rollouts=2,
                         infra={"max_retries": 1, "retry_backoff_s": 0.01, "setup_timeout_s": 3})  # fmt: skip
    assert str(error.value) == (
        "step 1: 1 of 1 groups lost to infrastructure errors (more than infra.max_lost_groups = 0.5); first in "
        "environment 'flaky-tools' (task t0), after 1 retries: SetupTimeoutError: set-up took more than "
        "infra.setup_timeout_s = 3.0s"
    )
    assert not rollouts_dir(flaky_tools_starts / "run", 1).exists()


def test_with_30_percent_of_tool_server_starts_crashing_a_step_loses_nothing_and_counts_its_retries(
    flaky_tools_starts, monkeypatch
):
    monkeypatch.setenv("FLAKY_TOOLS_SHARE", "0.3")  # starts 3, 6, 9, ... crash
    starts_dir, output_dir = flaky_tools_starts / "starts", flaky_tools_starts / "run"
    starts_dir.mkdir()
    monkeypatch.setenv("FLAKY_TOOLS_DIR", str(starts_dir))
    flaky_tools_step(output_dir, rollouts=7,
                     infra={"max_retries": 2, "retry_backoff_s": 0.01, "max_concurrent_setups": 7,
                            "setup_timeout_s": 60})  # fmt: skip
    starts = len(list(starts_dir.iterdir()))
    crashed = sum(map(flaky_tools.crashes, range(starts)))
    assert crashed >= 2 and starts == 7 + crashed  # each crash was run again, and every rollout served
    (record,) = read_metrics(output_dir, "orchestrator")
    assert record["infra/flaky-tools/retries"] == crashed
    assert record["infra/flaky-tools/lost_groups"] == 0 and record["failed_rollouts"] == 0
    assert rollouts_dir(output_dir, 1).exists()  # the step's batch was written


def test_a_step_fails_only_past_the_share_of_lost_groups():
    def group(lost: bool) -> list[Rollout]:
        error = "ToolsetError: server did not report its port" if lost else None
        return [Rollout(reward=1.0, branches=[], ok=not lost, lost=lost, retries=3 * lost, error=error, env="e")] * 2

    check_lost(0, [group(True), group(False), group(False)], max_share=0.5)  # 1 of 3: the step goes on
    with pytest.raises(TridentError, match=r"^step 0: 2 of 3 groups lost .* after 3 retries: ToolsetError: server"):
        check_lost(0, [group(True), group(True), group(False)], max_share=0.5)
    with pytest.raises(TridentError, match="^step 0: 1 of 1 groups lost"):
        check_lost(0, [group(True)], max_share=1.0)  # nothing left to train on
