"""How busy the processes that run rollouts are: a process's CPU seconds as the kernel counts them, the busiest
process's share of a core over a step, and the one line that says rollouts wait for the CPU."""

import logging
import os
import time
from types import SimpleNamespace

import pytest

from orchestrator.loop.groups import busiest_share
from orchestrator.loop.run import Orchestrator
from orchestrator.loop.workers import cpu_seconds


def test_a_processs_cpu_seconds_are_what_it_burns():
    before, own = cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - own < 0.3:
        pass
    burned = time.process_time() - own
    assert abs((cpu_seconds(os.getpid()) - before) - burned) < 0.05  # the kernel counts in 10 ms ticks
    assert cpu_seconds(2**22 + 1) == 0.0  # above Linux's largest pid: no such process


def test_the_busiest_process_sets_the_share_and_a_new_one_counts_from_zero():
    before = {1: 1.0, 2: 5.0}
    assert busiest_share(before, {1: 1.5, 2: 6.8, 3: 0.4}, 2.0) == pytest.approx(0.9)
    assert busiest_share(before, {3: 1.2}, 2.0) == pytest.approx(0.6)
    assert busiest_share({}, {}, 1.0) == 0.0


def test_a_cpu_bound_step_after_the_first_is_logged_once_naming_the_setting(caplog):
    cpu = {7: 0.0}
    runner = SimpleNamespace(workers=None, rollout_cpu=lambda: dict(cpu))
    orchestrator = SimpleNamespace(groups=runner, cpu_hinted=False, cpu_mark=(0.0, {}))

    def step(number: int, busy_s: float) -> float:
        orchestrator.cpu_mark = (time.perf_counter() - 1.0, dict(cpu))  # a step of a second
        cpu[7] += busy_s
        return Orchestrator.rollout_cpu_share(orchestrator, number)

    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        assert 0.9 < step(1, 1.0) <= 1.0  # step 1 includes start-up: not logged
        assert step(2, 0.5) <= 0.5
        assert not caplog.records
        assert step(3, 0.95) > 0.9 and step(4, 1.0) > 0.9
    (record,) = caplog.records
    assert record.getMessage().startswith("step 3: the orchestrator's process kept 9")
    assert "orchestrator.rollout_workers" in record.getMessage()
