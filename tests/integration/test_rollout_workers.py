"""Rollout worker processes (``rollout_workers``): groups run by workers come back as the orchestrator's own process
would run them, within each worker's share of the limits; a cancelled group frees what it held in its worker; a worker
killed mid-group has its group run again on a new one, a bounded number of times, and its tool servers stop at once; a
worker that cannot start is one clear error."""

import asyncio
import os
import signal
import threading
from pathlib import Path

import flaky_tools
import pytest
from fake_policy import CountingHandler, CountingServer, serving
from procs import alive

from contracts.errors import TridentError
from contracts.lifeline import marked
from orchestrator.batching.infra import check_lost, infra_metrics
from orchestrator.config import EnvConfig, InfraConfig, OrchestratorConfig
from orchestrator.loop.groups import connect
from orchestrator.loop.workers import RolloutWorkers
from orchestrator.verifiers_adapter.envs import load_env, load_tasks, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits

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
    """Two rollout workers on ``server``, at most ``per_server`` model calls in flight on it; a group whose worker
    dies runs again once (infra.max_retries = 1)."""
    client = {"base_url": server.base_url, "max_concurrent_per_server": per_server}
    return OrchestratorConfig(client=client, env=[{"id": ENV}], rollout_workers=2, infra={"max_retries": 1})


def tool_servers(starts: Path) -> set[int]:
    """The flaky-tools servers running that count their starts in ``starts``."""
    found = set()
    for pid, _ in marked("FLAKY_TOOLS_DIR", str(starts)):  # this process and the workers too
        try:
            if b"flaky_tools" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:  # gone meanwhile
            pass
    return found


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


async def a_group_whose_worker_keeps_dying_is_lost_and_its_tool_servers_stop(groups, env, task, starts) -> None:
    """A group whose worker is killed at each try, with its tool server starting (and never reaching the point where
    verifiers has it die with its parent): each killed worker's tool server stops at once, while the orchestrator
    runs on; after 1 + infra.max_retries tries the group is lost, counted as infrastructure losses are."""
    group = asyncio.ensure_future(groups.run(env, task))
    kills = 0
    while True:
        await until(lambda: group.done() or tool_servers(starts))
        if group.done():
            break
        assert kills < 2, "the group ran on a third worker: infra.max_retries = 1 allows two tries"
        servers = tool_servers(starts)
        (busy,) = [worker for worker in groups.workers.workers if worker is not None and worker.jobs]
        os.kill(busy.process.pid, signal.SIGKILL)
        kills += 1
        await until(lambda servers=servers: not any(map(alive, servers)), timeout_s=60)  # not left till the run ends
    rollouts = group.result()
    assert kills == 2 and len(rollouts) == 2
    assert all(r.lost and r.retries == 1 and r.error.startswith("WorkerLost: rollout worker") for r in rollouts)
    assert infra_metrics([rollouts])["infra/flaky-tools/lost_groups"] == 1
    with pytest.raises(TridentError, match=r"\(task t0\), after 1 retries: WorkerLost: rollout worker \d"):
        check_lost(1, [rollouts], max_share=0.5)


def test_groups_on_two_workers_as_in_process_cancelled_and_after_workers_are_killed(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(flaky_tools.__file__).parent))  # as verifiers starts its tool server
    monkeypatch.setenv("FLAKY_TOOLS_DIR", str(tmp_path))
    monkeypatch.setenv("FLAKY_TOOLS_HANG", "1")  # each start hangs before it is a verifiers server
    with held_server() as server:
        config = run_config(server, per_server=2)
        env, tools_env = load_env(config.env[0]), load_env(EnvConfig(id=flaky_tools.ENV_ID))
        tasks = load_tasks(env, 4)
        groups = connect(config, config.infra, 2)

        async def run():
            async with env.serving():
                try:
                    await same_as_in_process(groups, env, tasks, server)
                    await cancelled_groups_free_their_slots(groups, env, tasks, server)
                    await a_killed_workers_group_runs_again(groups, env, tasks[2], server)
                    task = load_tasks(tools_env, 1)[0]
                    await a_group_whose_worker_keeps_dying_is_lost_and_its_tool_servers_stop(
                        groups, tools_env, task, tmp_path
                    )
                finally:
                    server.release.set()
                    await groups.close()

        try:
            asyncio.run(run())
        finally:
            for pid in tool_servers(tmp_path):  # left by a failure
                os.kill(pid, signal.SIGKILL)
    assert f"exited with code {-signal.SIGKILL}: its groups run again, on a new worker" in caplog.text
    assert (
        "a group of task t0 in environment 'flaky-tools' is lost: its rollout worker died at each of its 2 tries "
        "(infra.max_retries = 1), last: rollout worker"
    ) in caplog.text


def test_a_worker_that_cannot_start_is_one_error_naming_it(tmp_path):
    with held_server() as server:
        config = run_config(server)
        workers = RolloutWorkers(1, config, InfraConfig(), str(tmp_path / "no-model"))
        env_config, task = config.env[0], load_tasks(load_env(config.env[0]), 1)[0]

        async def run():
            try:
                await workers.run_group(env_config, task, 1, server.base_url + "/v1", "tiny", "TRIDENT_API_KEY")
            finally:
                await workers.close()

        with pytest.raises(TridentError, match=r"rollout worker 0 exited with code 1 while starting"):
            asyncio.run(run())
