"""The runs one server serves: the unnamed run (``None``, a run without ``orchestrator.run_id``) and the named runs
sharing the server, each with what it is served, its own adapters and its share of the server's request slots.

A named run's generation requests are admitted at most ``limit`` at a time, its fair share of the slots among the
named runs active now (those with requests in flight or waiting): ``max(1, slots // active)``. The others wait at
the server, in the order they came, until one of the run's requests ends or the limit grows (another run goes
quiet). Unnamed requests are not limited. A named run that has sent nothing for ``idle_timeout_s`` (its
orchestrator was killed, and never released it) is evicted: its adapters are removed.
"""

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import HTTPException

from contracts import inference_api as api
from inference.adapters import Adapters


@dataclass
class Run:
    """One run on the server: what it is served, its adapters, and its requests."""

    served: api.Served
    adapters: Adapters | None  # None: the server runs without LoRA
    last_seen: float  # when the run last sent anything (clock seconds)
    in_flight: int = 0
    waiting: deque[asyncio.Future] = field(default_factory=deque)  # its requests over the limit, oldest first
    waited_s: float = 0.0
    requests: int = 0

    @property
    def holds_adapters(self) -> bool:
        return self.adapters is not None and bool(self.adapters.named)


class Runs:
    """Every run the server has seen and not released or evicted; the unnamed run is always there.

    ``adapters`` makes a run's :class:`Adapters` (None: no LoRA); at most ``max_named`` named runs hold adapters at
    once (vLLM keeps every adapter of that many resident: ``inference.server.vllm_argv``); ``slots`` are the
    request slots the named runs share; ``clock`` gives seconds.
    """

    def __init__(
        self,
        base_path: str,
        adapters: Callable[[], Adapters] | None,
        slots: int,
        max_named: int,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base_path = base_path
        self.new_adapters = adapters
        self.slots = slots
        self.max_named = max_named
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.runs: dict[str | None, Run] = {None: self.fresh()}

    def base(self) -> api.Served:
        """What a fresh server serves a run: the base model as step 0, no adapter."""
        return api.Served(step=0, path=self.base_path, adapter=None)

    def fresh(self) -> Run:
        """A run as a fresh server serves it (:meth:`base`)."""
        adapters = self.new_adapters() if self.new_adapters is not None else None
        return Run(self.base(), adapters, self.clock())

    def named(self) -> dict[str, Run]:
        return {run: state for run, state in self.runs.items() if run is not None}

    def get(self, run: str | None) -> Run:
        """The state of ``run`` (made on its first call), which has just sent something."""
        if run not in self.runs:
            self.runs[run] = self.fresh()
        state = self.runs[run]
        state.last_seen = self.clock()
        return state

    def for_adapter(self, run: str | None) -> Run:
        """The state of ``run`` about to load an adapter: a 409 for a named run beyond the ``max_named`` that may
        hold adapters at once."""
        holding = [name for name, state in self.named().items() if state.holds_adapters]
        if run is not None and run not in holding and len(holding) >= self.max_named:
            raise HTTPException(
                409,
                f"run {run!r}: {len(holding)} named runs already hold adapters on this server, the most its "
                f"[lora] max_loras allows ({self.max_named} = max_loras - 1); release one or raise max_loras",
            )
        return self.get(run)

    def served(self, run: str | None) -> api.Served:
        """What ``run`` is served (a run the server has not seen: the base model as step 0)."""
        return self.get(run).served if run in self.runs else self.base()

    async def release(self, run: str) -> bool:
        """Forget ``run`` and remove its adapters; its waiting requests go on (to find their adapter gone).
        Whether the server knew it."""
        state = self.runs.pop(run, None)
        if state is None:
            return False
        if state.adapters is not None:
            await state.adapters.remove_all()
        for waiter in state.waiting:
            if not waiter.done():
                state.in_flight += 1
                waiter.set_result(None)
        self.admit_waiting()  # the others' share grew
        return True

    async def evict_idle(self) -> list[str]:
        """Release the named runs that have sent nothing, and have nothing in flight or waiting, for
        ``idle_timeout_s``; their ids."""
        now = self.clock()
        idle = [
            run
            for run, state in self.named().items()
            if not state.in_flight and not state.waiting and now - state.last_seen > self.idle_timeout_s
        ]
        for run in idle:
            await self.release(run)
        return idle

    def active(self) -> int:
        """Named runs with requests in flight or waiting."""
        return sum(1 for state in self.named().values() if state.in_flight or state.waiting)

    def limit(self, state: Run) -> int:
        """The most requests ``state``'s run may have in flight now: its share of the slots among the active named
        runs, itself counted."""
        active = self.active() + (not state.in_flight and not state.waiting)
        return max(1, self.slots // active)

    def admit_waiting(self) -> None:
        """Admit each named run's oldest waiting requests while it is under its limit."""
        for state in self.named().values():
            while state.waiting and state.in_flight < self.limit(state):
                waiter = state.waiting.popleft()
                if not waiter.cancelled():  # else: its client has just gone away
                    state.in_flight += 1
                    waiter.set_result(None)

    @asynccontextmanager
    async def share(self, run: str) -> AsyncIterator[None]:
        """Hold one of ``run``'s slots for the block: at once when it is under its limit and none of its requests
        waits, else after those before it."""
        state = self.get(run)
        state.requests += 1
        if not state.waiting and state.in_flight < self.limit(state):
            state.in_flight += 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            state.waiting.append(waiter)
            start = self.clock()
            try:
                await waiter
            except asyncio.CancelledError:  # its client went away
                if waiter.cancelled():
                    if waiter in state.waiting:
                        state.waiting.remove(waiter)
                    self.admit_waiting()  # one fewer active run, maybe: the others' share grew
                else:  # admitted just as it went
                    self.leave(state)
                raise
            finally:
                state.waited_s += self.clock() - start
        try:
            yield
        finally:
            self.leave(state)

    def leave(self, state: Run) -> None:
        state.in_flight -= 1
        state.last_seen = self.clock()
        self.admit_waiting()

    def shares(self) -> dict[str, api.RunShare]:
        """``GET /runs``: each named run's :class:`~contracts.inference_api.RunShare`."""
        return {
            run: api.RunShare(
                **state.served.model_dump(),
                in_flight=state.in_flight,
                limit=self.limit(state),
                waiting=len(state.waiting),
                waited_s=round(state.waited_s, 4),
                requests=state.requests,
            )
            for run, state in self.named().items()
        }
