"""The inference servers a run samples from (``client.base_url``, one or several).

Every server gets each weight update and is probe-checked, so a step samples only from servers that serve its
weights. Rollouts are spread over them a group at a time: a group's rollouts share a prompt, which stays in one
server's prefix cache; a new group goes to the server with the fewest groups in flight.

A server that stops answering (connection refused, or no ``/health`` reply within ``client.stall_timeout_s``) is
set aside: what it was doing is cancelled and its groups run again on the others. At the start of each step a
server that answers again is brought to the run's current weights before it gets work; with the weight broadcast,
one that can no longer get them (the trainer has sent newer ones) stays aside and gets the newer ones at the next
reload. When none answers, :class:`NoServer` is raised and the orchestrator waits for one
(``client.server_timeout_s``).

A named run (``orchestrator.run_id``) shares its servers with other runs: it sees, changes and releases only its own
state on each (:class:`~orchestrator.serving.client.InferenceClient`).
"""

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import TypeVar

import httpx

from contracts.errors import TridentError
from contracts.inference_api import HEALTH, WEIGHTS
from orchestrator.serving.client import InferenceClient, Superseded

logger = logging.getLogger("orchestrator")

T = TypeVar("T")
WATCH_INTERVAL_S = 5.0  # how often each server's /health is asked while it is in use


class NoServer(TridentError):
    """No inference server of the run answers."""


class ServerDown(Exception):
    """The server a call ran on was set aside while the call ran."""


@dataclasses.dataclass(eq=False)
class Server:
    client: InferenceClient
    up: bool = True
    in_flight: int = 0  # groups running on it
    behind: bool = False  # set aside, answering, but could not get the run's broadcast weights: loaded at next reload
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set when it is set aside

    @property
    def url(self) -> str:
        return self.client.base_url


class Servers:
    def __init__(self, urls: list[str], timeout_s: float, model: str, stall_timeout_s: float, run: str | None = None):
        self.servers = [Server(InferenceClient(url, timeout_s, model, run=run)) for url in urls]
        self.stall_timeout_s = stall_timeout_s
        self.run = run

    @property
    def up(self) -> list[Server]:
        return [server for server in self.servers if server.up]

    def none_left(self) -> NoServer:
        return NoServer(f"no inference server answers (all {len(self.servers)} set aside)")

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Server]:
        """The least loaded server that is up, held while a group runs on it; :class:`NoServer` when none is."""
        if not self.up:
            raise self.none_left()
        server = min(self.up, key=lambda s: s.in_flight)
        server.in_flight += 1
        try:
            yield server
        finally:
            server.in_flight -= 1

    def set_aside(self, server: Server, reason: str) -> None:
        """Give ``server`` no more work and cancel what runs on it (:meth:`guard`)."""
        if not server.up:
            return
        server.up = False
        server.lost.set()
        left = len(self.up)
        logger.warning(
            f"inference server at {server.url} {reason}: set aside, "
            + (f"its rollouts go to the other {left}" if left else "no server left")
        )

    async def guard(self, server: Server, call: Awaitable[T]) -> T:
        """``call`` on ``server``, cancelled with :class:`ServerDown` if the server is set aside meanwhile (or the
        call cannot reach it)."""
        task = asyncio.ensure_future(call)
        lost = asyncio.ensure_future(server.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # the caller was cancelled: so is the call
            raise
        finally:
            lost.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            raise ServerDown(server.url)
        try:
            return task.result()
        except httpx.TransportError as e:
            self.set_aside(server, self.why(e))
            raise ServerDown(server.url) from e

    def why(self, error: httpx.HTTPError) -> str:
        """What a failed request says about its server, for the log."""
        if isinstance(error, httpx.TimeoutException):
            return f"stalled (no reply within {self.stall_timeout_s:.0f}s)"
        if isinstance(error, httpx.HTTPStatusError):
            return f"answers {error.response.status_code} to {error.request.url.path}"
        return f"cannot be reached ({type(error).__name__})"

    async def answers(self, server: Server) -> bool:
        """Whether ``server`` replies to ``/health`` within ``stall_timeout_s``; one that does not is set aside."""
        try:
            (await server.client.http.get(HEALTH, timeout=self.stall_timeout_s)).raise_for_status()
        except httpx.HTTPError as e:
            self.set_aside(server, self.why(e))
            return False
        return True

    async def watch(self) -> None:
        """Ask every server in use for ``/health`` every few seconds, setting aside those that do not answer."""

        async def watch_one(server: Server) -> None:
            while True:
                await asyncio.sleep(WATCH_INTERVAL_S)
                if server.up:
                    await self.answers(server)

        await asyncio.gather(*(watch_one(server) for server in self.servers))

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every server answers ``/health`` (at the start of a run)."""
        await asyncio.gather(*(server.client.wait_ready(timeout_s) for server in self.servers))

    async def wait_any(self, timeout_s: float) -> None:
        """Wait until some server answers ``/health`` again (:class:`TridentError` after ``timeout_s``)."""
        waits = [asyncio.ensure_future(server.client.wait_ready(timeout_s)) for server in self.servers]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            await next(iter(done))  # raises if it timed out
        finally:
            for wait in waits:
                wait.cancel()

    async def reset_weights(self) -> None:
        await asyncio.gather(*(server.client.reset_weights() for server in self.servers))

    async def serve_base_model(self, run_weights: Path, reset: bool) -> None:
        """Before a run's first step, have every server serve the model it started with (step 0): one serving this
        run's weights (``run_weights``, a resumed run's) is reset, one serving any other weights only with ``reset``
        (else a :class:`TridentError` naming it and what it serves: another run may be using it). A named run looks
        at, and resets, only what the server serves under its run id."""
        for server in self.servers:
            try:
                served = await server.client.served()
            except httpx.HTTPStatusError as e:
                status = e.response.status_code
                raise TridentError(
                    f"{server.url}: GET {WEIGHTS} answered {status}: not a Trident inference server?"
                ) from None
            if (served.step, served.adapter) == (0, None):
                server.client.use(served)
            elif reset or Path(served.path).is_relative_to(run_weights.resolve()):
                await server.client.reset_weights()
            else:
                other = f"another run with orchestrator.run_id = {self.run!r}" if self.run else "another run"
                raise TridentError(
                    f"the inference server at {server.url} serves weights step {served.step} from {served.path}, not "
                    f"this run's: {other} may be using it; pass --orchestrator.reset (reset = true in the "
                    f"orchestrator's file) to have this run serve its own model there again"
                )

    async def bring_to(self, path: Path | None, step: int, tolerance: float | None) -> None:
        """Make every server serve weights ``step`` (``path``; None: the base model) before it gets work: one set
        aside that answers again, or one that serves another step (restarted). One that cannot be reached is
        set aside; :class:`NoServer` if none is left."""

        async def check(server: Server) -> None:
            try:
                served = await server.client.served(timeout_s=self.stall_timeout_s)
            except httpx.HTTPError as e:
                self.set_aside(server, self.why(e))
                return
            if served.step == step:
                server.client.use(served)
            else:
                logger.warning(
                    f"inference server at {server.url} serves weights step {served.step}, not {step}: "
                    f"loading step {step}"
                )
                try:
                    await self.load(server, path, step, tolerance)
                except httpx.TransportError as e:
                    self.set_aside(server, self.why(e))
                    return
                except Superseded as e:
                    self.fall_behind(server, e)
                    return
            if not server.up:
                self.rejoin(server, step)

        await asyncio.gather(*(check(server) for server in self.servers))
        if not self.up:
            raise self.none_left()

    def fall_behind(self, server: Server, error: Superseded) -> None:
        """``server`` could not get the broadcast weights it was to load: aside until the next reload."""
        self.set_aside(server, f"could not load the run's weights ({error})")
        server.behind = True

    def rejoin(self, server: Server, step: int) -> None:
        """``server``, set aside, serves the run's weights ``step`` again: it gets work again."""
        logger.info(f"inference server at {server.url} is back, serving weights step {step}")
        server.up, server.lost, server.behind = True, asyncio.Event(), False

    async def load(
        self, server: Server, path: Path | None, step: int, tolerance: float | None
    ) -> tuple[float, float | None]:
        """Make ``server`` serve weights ``step`` from ``path`` (None: its base model), probe-checked; the reload's
        seconds and the probe gap (None without a probe)."""
        if path is None:
            await server.client.reset_weights()
            return 0.0, None
        seconds = await server.client.reload_weights(path, step)
        return seconds, await server.client.check_probe(path, step, tolerance)

    async def reload_weights(self, path: Path, step: int, tolerance: float | None) -> tuple[float, float | None]:
        """Every server in use, and every one that fell behind (:meth:`fall_behind`), loads the weights in ``path``
        and is probe-checked (:meth:`InferenceClient.check_probe`); returns the slowest reload's seconds and the
        largest probe gap (None without a probe). A server set aside meanwhile, or that cannot get broadcast weights
        the trainer has replaced since, is skipped; :class:`NoServer` if none is left."""

        async def reload(server: Server) -> tuple[float, float | None]:
            if server.up:
                return await self.guard(server, self.load(server, path, step, tolerance))
            try:
                loaded = await self.load(server, path, step, tolerance)
            except httpx.TransportError as e:
                server.behind = False
                raise ServerDown(server.url) from e
            self.rejoin(server, step)
            return loaded

        targets = [server for server in self.servers if server.up or server.behind]
        results = []
        for server, result in zip(
            targets, await asyncio.gather(*(reload(server) for server in targets), return_exceptions=True), strict=True
        ):
            if isinstance(result, Superseded):
                self.fall_behind(server, result)
            elif isinstance(result, BaseException) and not isinstance(result, ServerDown):
                raise result
            elif not isinstance(result, BaseException):
                results.append(result)
        if not results:
            raise self.none_left()
        gaps = [gap for _, gap in results if gap is not None]
        return max(seconds for seconds, _ in results), max(gaps) if gaps else None

    async def release_run(self) -> None:
        """A named run has ended: tell every server (best effort, :meth:`InferenceClient.release_run`)."""
        await asyncio.gather(*(server.client.release_run() for server in self.servers))

    async def close(self) -> None:
        await asyncio.gather(*(server.client.close() for server in self.servers))
