"""Rollouts spread over worker processes (``rollout_workers``).

One orchestrator process runs out of CPU at a few hundred model turns a second: verifiers' work per turn (its
interception endpoint, message graph and renderer) costs about 2 ms (docs/benchmarks.md). A run whose servers answer
faster than that gives its groups to workers, each running them as the orchestrator itself would
(:func:`~orchestrator.verifiers_adapter.envs.run_group`) on an event loop of its own.

The orchestrator keeps everything else: which server a group runs on, weight updates, batches, checkpoints. A worker
is sent each group's environment config, task, size and server; it loads each environment once, keeps it serving,
and sends back the finished rollouts. Each worker holds an equal share (rounded up) of the run's limits: rollouts in
flight, set-ups, model calls per server. Messages are pickled, each after its length, over a socket pair.

A worker that dies fails its groups with :class:`WorkerLost`, so that they run again (up to ``infra.max_retries``
times, :class:`~orchestrator.loop.groups.GroupRunner`), and a new one starts in its place. What it started is stopped at
once, however it ended: each worker is marked with ``$TRIDENT_WORKER_MARK``, which its tool servers and programs
inherit, and once it is gone the orchestrator stops what still carries the mark (:func:`contracts.lifeline.stop_marked`;
verifiers' own tool servers ask to die with their parent only once started, seconds after it starts them).
"""

import asyncio
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
from contextlib import AsyncExitStack
from pathlib import Path

from contracts.errors import TridentError
from contracts.lifeline import stop_descendants_on_exit, stop_marked
from contracts.metrics import setup_logging
from orchestrator.batching.rollout import Rollout
from orchestrator.config import EnvConfig, EvalRunConfig, InfraConfig, OrchestratorConfig
from orchestrator.loop.gc_tuning import tune_gc
from orchestrator.verifiers_adapter.envs import at_server, load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import run_limits
from orchestrator.verifiers_adapter.patches import install_patches

logger = logging.getLogger("orchestrator")

WORKER_MARK_ENV = "TRIDENT_WORKER_MARK"  # in each worker's environment, and so in that of everything it starts
_worker_starts = itertools.count()  # of this process's pools, so that no two workers share a mark


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` (all its threads) has used, from Linux's ``/proc``; 0 when it
    cannot be read (gone, or not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


class WorkerLost(Exception):
    """The worker process running a group ended before the group did."""


def frame(message: tuple) -> bytes:
    """``message`` as sent: its pickle, after the pickle's length."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(8, "big") + data


async def send(writer: asyncio.StreamWriter, message: tuple) -> None:
    writer.write(frame(message))
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> tuple:
    """The next message; :class:`asyncio.IncompleteReadError` once the other side has closed."""
    size = int.from_bytes(await reader.readexactly(8), "big")
    return pickle.loads(await reader.readexactly(size))


@dataclasses.dataclass(eq=False)
class _Worker:
    number: int
    mark: str  # its $TRIDENT_WORKER_MARK: this orchestrator's pid and the worker's start
    process: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    jobs: dict[int, asyncio.Future] = dataclasses.field(default_factory=dict)
    rollouts: int = 0  # rollouts of its groups in flight
    ready: bool = False  # it has loaded its config and answered
    reading: asyncio.Task | None = None  # hands its answers to their groups


class RolloutWorkers:
    """``count`` worker processes that run groups for an orchestrator (or ``eval``) with ``config`` and ``infra``,
    the model's tokenizer at ``model_path``. Started at the first group; :meth:`close` stops them."""

    def __init__(self, count: int, config: OrchestratorConfig | EvalRunConfig, infra: InfraConfig, model_path: str):
        self.count = count
        self.setup = (config, infra, model_path, count)
        self.workers: list[_Worker | None] = [None] * count
        self.starting = asyncio.Lock()
        self.job_ids = itertools.count(1)
        self.restarts = 0

    @property
    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self.workers if worker is not None]

    async def run_group(self, env_config: EnvConfig, task, n: int, base_url: str, model: str, api_key_var: str
                        ) -> list:  # fmt: skip
        """The rollouts of a group of ``n`` of ``task`` in ``env_config``'s environment, sampled from the server at
        ``base_url`` (its ``/v1`` URL) as ``model`` with the key in ``api_key_var``, run by the least busy worker.
        Cancelling this cancels the group in the worker; :class:`WorkerLost` if the worker ends first."""
        job = next(self.job_ids)
        try:
            message = frame(("run", job, env_config, task, n, base_url, model, api_key_var))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TridentError(
                f"environment {env_config.id!r}: its task {type(task).__name__} cannot be sent to a rollout worker "
                f"({type(e).__name__}: {e}); run its rollouts in the orchestrator with rollout_workers = 1"
            ) from None
        worker = await self._least_busy()
        future = asyncio.get_running_loop().create_future()
        worker.jobs[job] = future
        worker.rollouts += n
        try:
            worker.writer.write(message)
            await worker.writer.drain()
            kind, value = await future
        except asyncio.CancelledError:
            if worker.process.returncode is None and not worker.writer.is_closing():
                worker.writer.write(frame(("cancel", job)))  # no drain: a cancelled task must not wait
            raise
        finally:
            worker.jobs.pop(job, None)
            worker.rollouts -= n
        if kind == "error":
            raise RuntimeError(f"rollout worker {worker.number}: {value}")
        return value

    async def _least_busy(self) -> _Worker:
        async with self.starting:
            for number, worker in enumerate(self.workers):
                if worker is None or worker.process.returncode is not None:
                    self.workers[number] = await self._start(number)
        return min(self.workers, key=lambda worker: worker.rollouts)

    async def _start(self, number: int) -> _Worker:
        mine, theirs = socket.socketpair()
        mark = f"{os.getpid()}.{next(_worker_starts)}"
        with theirs:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orchestrator.loop.workers", str(theirs.fileno()), pass_fds=(theirs.fileno(),),
                env=os.environ | {WORKER_MARK_ENV: mark},
            )  # fmt: skip
        reader, writer = await asyncio.open_connection(sock=mine)
        worker = _Worker(number, mark, process, writer)
        await send(writer, ("init", number, *self.setup))
        worker.reading = asyncio.create_task(self._read(worker, reader))
        logger.debug(f"rollout worker {number} started (pid {process.pid})")
        return worker

    async def _read(self, worker: _Worker, reader: asyncio.StreamReader) -> None:
        """Hand each of ``worker``'s answers to its group; when it ends, fail the groups it still had and stop what
        it left running."""
        try:
            while True:
                message = await receive(reader)
                if message[0] == "ready":
                    worker.ready = True
                    continue
                kind, job, value = message  # "done" with the rollouts, or "error" with what went wrong
                if (future := worker.jobs.get(job)) is not None and not future.done():
                    future.set_result((kind, value))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        code = await worker.process.wait()
        worker.writer.close()
        lost = WorkerLost(f"rollout worker {worker.number} (pid {worker.process.pid}) exited with code {code}")
        if not worker.ready:
            lost = TridentError(f"rollout worker {worker.number} exited with code {code} while starting; its log "
                                "lines above say why")  # fmt: skip
        elif self.workers[worker.number] is worker:
            logger.warning(f"{lost}: its groups run again, on a new worker (each up to infra.max_retries times)")
            self.restarts += 1
        for future in worker.jobs.values():
            if not future.done():
                future.set_exception(lost)
        await asyncio.to_thread(stop_marked, WORKER_MARK_ENV, worker.mark)

    async def close(self) -> None:
        """Stop the workers: each cancels its groups, leaves its environments and exits."""
        workers = [worker for worker in self.workers if worker is not None]
        self.workers = [None] * self.count
        for worker in workers:
            worker.writer.close()
        await asyncio.gather(*(worker.process.wait() for worker in workers))
        await asyncio.gather(*(worker.reading for worker in workers), return_exceptions=True)  # and what they left


class WorkerGroups:
    """A worker's side: the environments it has loaded (each serving until the worker ends), the model context and
    its share of the run's limits."""

    def __init__(self, stack: AsyncExitStack, config: OrchestratorConfig | EvalRunConfig, infra: InfraConfig,
                 model_path: str, workers: int):  # fmt: skip
        self.stack = stack
        self.ctx = model_context(config, model_path)
        self.limits = run_limits(config, infra, workers)
        self.output_dir = config.output_dir  # where the rollouts' images are stored
        self.envs: dict[str, asyncio.Task] = {}

    async def env(self, env_config: EnvConfig):
        """``env_config``'s environment, loaded and serving at its first group."""
        key = env_config.model_dump_json()
        if key not in self.envs:
            self.envs[key] = asyncio.ensure_future(self._load(env_config))
        return await asyncio.shield(self.envs[key])  # a cancelled group does not cancel the load others wait on

    async def _load(self, env_config: EnvConfig):
        env = load_env(env_config)
        await self.stack.enter_async_context(env.serving())
        return env

    async def run(self, env_config: EnvConfig, task, n: int, base_url: str, model: str, api_key_var: str
                  ) -> list[Rollout]:  # fmt: skip
        ctx = at_server(self.ctx, base_url, model, api_key_var)
        return await run_group(await self.env(env_config), task, n, ctx, self.limits, self.output_dir)


async def serve(sock: socket.socket) -> None:
    """Run the groups the orchestrator sends over ``sock`` until it closes the connection."""
    reader, writer = await asyncio.open_connection(sock=sock)
    _, number, config, infra, model_path, workers = await receive(reader)
    install_patches(config.datasets)  # the orchestrator's map of hub datasets to local data
    setup_logging(f"orchestrator-worker{number}", config.log.level)
    running: dict[int, asyncio.Task] = {}

    async def answer(job: int, groups: WorkerGroups, args: tuple) -> None:
        try:
            reply = ("done", job, await groups.run(*args))
        except Exception as e:  # run_group turns the environment's faults into failed rollouts: this is ours
            logger.exception(f"a group failed in rollout worker {number}")
            reply = ("error", job, f"{type(e).__name__}: {e}")
        if not writer.is_closing():
            await send(writer, reply)

    async with AsyncExitStack() as stack:
        groups = WorkerGroups(stack, config, infra, model_path, workers)
        tune_gc()
        await send(writer, ("ready",))
        while True:
            try:
                message = await receive(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break  # the orchestrator closed the connection, or ended
            if message[0] == "run":
                job = message[1]
                running[job] = asyncio.create_task(answer(job, groups, message[2:]))
                running[job].add_done_callback(lambda _, job=job: running.pop(job, None))
            elif message[0] == "cancel" and message[1] in running:
                running[message[1]].cancel()
        left = list(running.values())
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the orchestrator decides
    stop_descendants_on_exit()  # the tool servers of this worker's rollouts
    asyncio.run(serve(socket.socket(fileno=int(sys.argv[1]))))


if __name__ == "__main__":
    main()
