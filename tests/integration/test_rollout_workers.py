"""Rollout worker processes (``rollout_workers``): groups run by workers come back as the orchestrator's own process
would run them, within each worker's share of the limits; a cancelled group frees what it held in its worker; a worker
killed mid-group has its group run again on a new one; a worker that cannot start is one clear error."""

import asyncio
import os
import signal
import threading

import pytest
from fake_policy import CountingHandler, CountingServer, serving

from contracts.errors import TridentError
from orchestrator.config import InfraConfig, OrchestratorConfig
from orchestrator.groups import connect
from orchestrator.verifiers_adapter.envs import load_env, load_tasks, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits
from orchestrator.workers import RolloutWorkers

ENV = "reverse-text"


class HeldHandler(CountingHandler):
    """Answers "hi" once the server's ``release`` is set, counting the requests in flight meanwhile."""

    def do_POST(self) -> None:
        self.read_json()
        with self.server.lock:
            self.server.in_flight += 1
            self.server.peak = max(self.server.peak, self.server.in_flight)
        self.server.release.wait()
        with self.server.lock:
            self.server.in_flight -= 1
        self.respond(200, self.server.hi)


def held_server():
    server = CountingServer(delay_s=0.0)
    server.RequestHandlerClass = HeldHandler
    server.release = threading.Event()
    server.release.set()
    return serving(server)


def run_config(server, per_server: int = 64) -> OrchestratorConfig:
    """Two rollout workers on ``server``, at most ``per_server`` model calls in flight on it."""
    client = {"base_url": server.base_url, "max_concurrent_per_server": per_server}
    return OrchestratorConfig(client=client, env=[{"id": ENV}], rollout_workers=2)


async def until(condition, timeout_s: float = 120.0) -> None:
    """Return once ``condition()`` holds (polled every 50 ms); ``TimeoutError`` after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


def samples(rollouts) -> list:
    return [(r.ok, r.reward, r.turns, r.branches) for r in rollouts]


async def same_as_in_process(groups, env, tasks, server) -> None:
    """Groups run by the workers give the rollouts this process gives, each worker within its share of the limits."""
    ctx = groups.context(groups.servers.servers[0])
    own = [await run_group(env, task, 2, ctx, RolloutLimits.of(2)) for task in tasks]
    server.peak = 0
    by_workers = await asyncio.gather(*(groups.run(env, task) for task in tasks))
    assert [samples(group) for group in by_workers] == [samples(group) for group in own]
    assert all(r.ok and r.branches for group in by_workers for r in group)
    assert len(groups.workers.pids) == 2 and os.getpid() not in groups.workers.pids
    cpu = groups.rollout_cpu()  # what rollout_cpu_share is computed from: the workers' CPU
    assert cpu.keys() == set(groups.workers.pids) and all(seconds > 0 for seconds in cpu.values())
    assert server.peak <= 2  # each worker within its share (1) of max_concurrent_per_server


async def cancelled_groups_free_their_slots(groups, env, tasks, server) -> None:
    """Cancelled groups (as when their server is set aside) are cancelled in their workers: what they held there is
    free for the next group, while their own calls still hang in the server."""
    server.release.clear()  # model calls now hang until released
    held = asyncio.gather(*(groups.run(env, task) for task in tasks[:2]))  # a group per worker
    await until(lambda: server.in_flight == 2)  # each worker's one slot taken
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    again = asyncio.ensure_future(groups.run(env, tasks[1]))
    await until(lambda: server.in_flight > 2, timeout_s=60)  # the new group's calls reached the server
    server.release.set()
    assert all(r.ok for r in await again)
    await until(lambda: server.in_flight == 0)


async def a_killed_workers_group_runs_again(groups, env, task, server) -> None:
    """A worker killed mid-group: the group runs again, on a new worker in its place."""
    server.release.clear()
    group = asyncio.ensure_future(groups.run(env, task))
    await until(lambda: server.in_flight == 1)
    (busy,) = [worker for worker in groups.workers.workers if worker is not None and worker.jobs]
    os.kill(busy.process.pid, signal.SIGKILL)
    await until(lambda: groups.workers.restarts == 1)
    server.release.set()
    rollouts = await group
    assert len(rollouts) == 2 and all(r.ok for r in rollouts)
    assert busy.process.pid not in groups.workers.pids and len(groups.workers.pids) == 2


def test_groups_on_two_workers_as_in_process_cancelled_and_after_a_worker_is_killed(caplog):
    with held_server() as server:
        config = run_config(server, per_server=2)
        env = load_env(config.env[0])
        tasks = load_tasks(env, 4)
        groups = connect(config, config.infra, 2)

        async def run():
            async with env.serving():
                try:
                    await same_as_in_process(groups, env, tasks, server)
                    await cancelled_groups_free_their_slots(groups, env, tasks, server)
                    await a_killed_workers_group_runs_again(groups, env, tasks[2], server)
                finally:
                    server.release.set()
                    await groups.close()

        asyncio.run(run())
    assert f"exited with code {-signal.SIGKILL}: its groups run again, on a new worker" in caplog.text


def test_a_worker_that_cannot_start_is_one_error_naming_it(tmp_path):
    with held_server() as server:
        config = run_config(server)
        workers = RolloutWorkers(1, config, InfraConfig(), str(tmp_path / "no-model"))
        env_config, task = config.env[0], load_tasks(load_env(config.env[0]), 1)[0]

        async def run():
            try:
                await workers.run_group(env_config, task, 1, server.base_url + "/v1", "tiny")
            finally:
                await workers.close()

        with pytest.raises(TridentError, match=r"rollout worker 0 exited with code 1 while starting"):
            asyncio.run(run())
