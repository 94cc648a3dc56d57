"""The orchestrator's limits, against a real verifiers environment and a fake inference server that counts what is
in flight: set-ups at once (a slow task set-up), model calls on each server; and the bound on the share of groups a
step may lose. A per-rollout MCP tool server that crashes on start (a process of its own: retried; lost past the
retries, and the step fails past the bound) is checked in tests/integration/test_tool_server_limits.py."""

import asyncio
import itertools
import sys

import pytest
import verifiers.v1 as vf
from fake_policy import counting_server, rollouts_of
from rollouts import rollout

from contracts.errors import TridentError
from orchestrator.batching.infra import check_lost
from orchestrator.batching.rollout import Rollout
from orchestrator.config import InfraConfig, OrchestratorConfig
from orchestrator.verifiers_adapter.harness import InProcessHarness
from orchestrator.verifiers_adapter.limits import (
    RolloutLimits,
    default_setups,
    limit_generation,
    model_call_slot,
    run_limits,
)

ENV_ID = "trident-test-limits"  # this module is the environment of this id
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])


class SlowSetupData(vf.TaskData):
    setup_s: float = 0.3


class SlowSetupTask(vf.Task[SlowSetupData, vf.State, vf.TaskConfig]):
    setting_up = peak = 0  # set-ups running now, and the most at once
    timed: list[tuple[float, float]] = []  # each rollout's set-up as verifiers timed it: (boot start, set-up end)

    async def setup(self, trace: vf.Trace, runtime) -> None:
        cls = SlowSetupTask
        cls.setting_up += 1
        cls.peak = max(cls.peak, cls.setting_up)
        await asyncio.sleep(self.data.setup_s)
        cls.setting_up -= 1

    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        SlowSetupTask.timed.append((trace.timing.boot.start, trace.timing.setup.end))
        return 1.0


class SlowSetupTaskset(vf.Taskset[SlowSetupTask, vf.TasksetConfig]):
    def load(self):
        yield SlowSetupTask(SlowSetupData(id="t0", prompt="Say hi."), self.config.task)


__all__ = ["InProcessHarness", "SlowSetupTaskset"]


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most of ``intervals`` (start, end) that overlap at any instant (one ending as another starts: not both)."""
    changes = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    return max(itertools.accumulate(change for _, change in changes))


def test_set_ups_past_the_limit_wait_for_a_slot_and_their_time_is_measured():
    """Each rollout's ``setup_s`` is its own set-up, timed once it holds a slot: no more than the limit of the timed
    set-ups overlap (counting the waits, all 6 would have begun together)."""
    SlowSetupTask.peak, SlowSetupTask.timed = 0, []
    with counting_server() as server:
        rollouts = rollouts_of(ENV_ID, server.base_url, 6, RolloutLimits.of(rollouts=6, setups=2))
    assert SlowSetupTask.peak == 2
    assert all(r.ok for r in rollouts), [r.error for r in rollouts]
    assert sorted(r.setup_s for r in rollouts) == sorted(end - start for start, end in SlowSetupTask.timed)
    assert all(r.setup_s >= 0.3 for r in rollouts)  # its own set-up is in it
    assert most_at_once(SlowSetupTask.timed) == 2  # and no wait for a slot
    first = min(start for start, _ in SlowSetupTask.timed)
    assert most_at_once([(first, end) for _, end in SlowSetupTask.timed]) == 6  # timed with the waits, they would


def test_model_calls_per_server_are_limited_not_the_rollouts():
    with counting_server(delay_s=0.3) as server:
        limit_generation([server.base_url], 2)
        try:
            rollouts = rollouts_of(ENV_ID, server.base_url, 6, RolloutLimits.of(rollouts=6, setups=6))
        finally:
            limit_generation([], 1)
    assert all(r.ok for r in rollouts) and server.peak == 2


def test_a_step_fails_only_past_the_share_of_lost_groups():
    def group(lost: bool) -> list[Rollout]:
        error = "ToolsetError: server did not report its port" if lost else None
        return [rollout(1.0, ok=not lost, lost=lost, retries=3 * lost, error=error, env="e")] * 2

    check_lost(0, [group(True), group(False), group(False)], max_share=0.5)  # 1 of 3: the step goes on
    with pytest.raises(TridentError, match=r"^step 0: 2 of 3 groups lost .* after 3 retries: ToolsetError: server"):
        check_lost(0, [group(True), group(True), group(False)], max_share=0.5)
    with pytest.raises(TridentError, match="^step 0: 1 of 1 groups lost"):
        check_lost(0, [group(True)], max_share=1.0)  # nothing left to train on


def test_each_rollout_worker_gets_an_equal_share_of_each_limit_rounded_up():
    urls = ["http://a:8000", "http://b:8000"]
    config = OrchestratorConfig(client={"base_url": urls, "max_concurrent_per_server": 64}, max_concurrent=100)
    try:
        whole = run_limits(config, InfraConfig(max_concurrent_setups=5))
        assert (whole.rollouts._value, whole.setups._value) == (100, 5)
        assert [model_call_slot(f"{url}/v1")._value for url in urls] == [64, 64]
        third = run_limits(config, InfraConfig(max_concurrent_setups=5, max_retries=7), workers=3)
        assert (third.rollouts._value, third.setups._value, third.max_retries) == (34, 2, 7)
        assert [model_call_slot(f"{url}/v1")._value for url in urls] == [22, 22]
        many = run_limits(config.model_copy(update={"max_concurrent": None}), InfraConfig(), workers=1000)
        assert (many.rollouts._value, many.setups._value) == (1, 1)  # never none
        assert run_limits(config, InfraConfig()).setups._value == default_setups()
    finally:
        limit_generation([], 1)
