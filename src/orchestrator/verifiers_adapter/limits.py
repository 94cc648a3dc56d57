"""How much of each costly thing a run does at once: rollouts, their set-ups, and model calls on each server.

verifiers 0.4.0 sets a rollout up and calls the model inside ``Env.run_slot``, so two limits sit where it does
that work:

- a set-up (``Rollout.open``: runtime start, task and harness set-up, tool servers) holds a slot of the run's
  set-up limit, which the rollout carries in a context variable; waiting for the slot is not set-up time. A set-up
  past its time fails with :class:`SetupTimeoutError`; one whose tool server (a background process of its
  subprocess runtime) exits fails at once with ``ToolsetError``, naming the exit code and the server's last log
  line (verifiers would poll the dead server for 180 s);
- a model call (``TrainClient.get_response``, which every harness's calls reach, and a judge's call to a run's
  server) holds a slot of the server it is sent to, so a rollout that runs a tool or sets up holds none and a
  server's batch fills with the calls of other rollouts.

:func:`~orchestrator.verifiers_adapter.patches.install_patches` puts :func:`limited_open`,
:func:`watched_run_background` and :func:`limited_get_response` in place of verifiers' methods.
"""

import asyncio
import contextlib
import math
import os
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from verifiers.v1.clients.train import TrainClient
from verifiers.v1.errors import RolloutError, ToolsetError
from verifiers.v1.rollout import Rollout
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

from orchestrator.config import EvalRunConfig, InfraConfig, OrchestratorConfig

_setups: ContextVar["RolloutLimits | None"] = ContextVar("trident_setups", default=None)
_generation: dict[str, asyncio.Semaphore] = {}  # model calls in flight, by the server's /v1 URL
# the servers (tool servers) a set-up started in the background, and their logs
_started: ContextVar[list[tuple[asyncio.subprocess.Process, Path]] | None] = ContextVar("trident_started", default=None)
EXIT_POLL_S = 0.2  # how often a set-up looks for a tool server that exited


@dataclass
class RolloutLimits:
    """What a group's rollouts may hold at once, and how they retry infrastructure errors."""

    rollouts: asyncio.Semaphore  # rollouts in flight, from set-up to score
    setups: asyncio.Semaphore  # rollouts setting up
    setup_timeout_s: float | None = None  # seconds a set-up may take once it has its slot
    max_retries: int = 0  # retries of a rollout that fails with an infrastructure error
    backoff_s: float = 1.0  # the wait before its first retry, doubled for each next one (at most 30 s)

    @classmethod
    def of(cls, rollouts: int, setups: int | None = None, setup_timeout_s: float | None = None, max_retries: int = 0,
           backoff_s: float = 1.0):  # fmt: skip
        """Limits of ``rollouts`` in flight and ``setups`` setting up (None: :func:`default_setups`)."""
        semaphores = asyncio.Semaphore(rollouts), asyncio.Semaphore(setups or default_setups())
        return cls(*semaphores, setup_timeout_s, max_retries, backoff_s)

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (from 0)."""
        return min(self.backoff_s * 2**retry, 30.0)

    @contextlib.contextmanager
    def setting_up(self):
        """Rollouts started inside take their set-up slot from these limits."""
        token = _setups.set(self)
        try:
            yield
        finally:
            _setups.reset(token)


def default_setups() -> int:
    """Set-ups at once when the config names none: one per CPU core (a tool server's start is mostly imports)."""
    return os.cpu_count() or 1


def run_limits(config: OrchestratorConfig | EvalRunConfig, infra: InfraConfig, workers: int = 1) -> RolloutLimits:
    """The limits of a run with ``config`` and ``infra``, and its model calls limited per server from now on; with
    several rollout workers (:mod:`orchestrator.loop.workers`), one worker's equal share of each, rounded up."""

    def share(total: int) -> int:
        return max(1, math.ceil(total / workers))

    client = config.client
    limit_generation(client.base_urls, share(client.max_concurrent_per_server))
    return RolloutLimits.of(
        share(client.rollouts_in_flight(config.max_concurrent)), share(infra.max_concurrent_setups or default_setups()),
        infra.setup_timeout_s, infra.max_retries, infra.retry_backoff_s,
    )  # fmt: skip


def limit_generation(base_urls: list[str], per_server: int) -> None:
    """At most ``per_server`` model calls in flight to each server of ``base_urls`` (the run's, from now on)."""
    _generation.clear()
    _generation.update({f"{url.rstrip('/')}/v1": asyncio.Semaphore(per_server) for url in base_urls})


def model_call_slot(base_url: str) -> contextlib.AbstractAsyncContextManager:
    """The slot a model call to ``base_url`` (a server's ``/v1`` URL) holds: one of its server's, for the run's
    servers; none for another URL."""
    return _generation.get(base_url.rstrip("/")) or contextlib.nullcontext()


# verifiers' own methods, which the replacements installed by orchestrator.verifiers_adapter.patches call
_open = Rollout.open
_get_response = TrainClient.get_response
_run_background = SubprocessRuntime.run_background


class SetupTimeoutError(RolloutError):
    """A rollout's set-up took longer than ``infra.setup_timeout_s``."""


async def limited_open(self: Rollout) -> bool:
    """``Rollout.open`` holding a set-up slot, within the set-up's time, failed at once when a tool server exits."""
    limits = _setups.get()
    if limits is None:
        return await _open(self)
    async with limits.setups:
        token = _started.set([])
        try:
            async with asyncio.timeout(limits.setup_timeout_s):
                return await _open_while_servers_live(self)
        except TimeoutError:  # open() freed what it had started when cancelled
            self.fail(SetupTimeoutError(f"set-up took more than infra.setup_timeout_s = {limits.setup_timeout_s}s"))
            return False
        finally:
            _started.reset(token)


async def _open_while_servers_live(rollout: Rollout) -> bool:
    """``rollout.open()``; cancelled (freeing what it started) as soon as a tool server it started exits, which fails
    the rollout with a ``ToolsetError``."""
    opening = asyncio.ensure_future(_open(rollout))
    exited = None  # what the first server that exited left (read before its runtime is freed)
    try:
        while not exited and not (await asyncio.wait([opening], timeout=EXIT_POLL_S))[0]:
            exited = next((server_exit(p, log) for p, log in _started.get() if p.returncode is not None), None)
    finally:
        if not opening.done():  # a server exited, or the set-up itself was cancelled (its timeout)
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await opening
    if exited:
        rollout.fail(ToolsetError(exited))
        return False
    return opening.result()


def server_exit(process: asyncio.subprocess.Process, log: Path) -> str:
    """What a tool server that exited during set-up left: its exit code and the last line of its log."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return f"tool server exited with code {process.returncode} during set-up" + (f": {lines[-1]}" if lines else "")


async def watched_run_background(self: SubprocessRuntime, argv: list[str], env: dict[str, str], log: str) -> None:
    """``SubprocessRuntime.run_background``, the servers it started recorded for the set-up that waits on them."""
    known = set(map(id, self._background))
    await _run_background(self, argv, env, log)
    if (started := _started.get()) is not None:
        started.extend((p, self.workdir / log) for p in self._background if id(p) not in known)


async def limited_get_response(self: TrainClient, *args, **kwargs):
    """``TrainClient.get_response`` holding a slot of the server it is sent to."""
    async with model_call_slot(self.config.base_url):
        return await _get_response(self, *args, **kwargs)
