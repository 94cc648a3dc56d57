"""Reading an environment's tasks (:class:`Tasks`): a finite taskset is held whole (:class:`TaskList`); an endless
one (or one longer than ``[[env]] max_tasks``) is a :class:`TaskStream`, read lazily, holding only the tasks the run
can still draw.

Either is indexed by position: task ``i`` is the ``i``-th its ``load()`` yields. Which positions a step draws is
:mod:`~orchestrator.tasks.sampler`'s business; see docs/environments.md#task-streams.
"""

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from contracts.checkpoint import CannotResume
from contracts.errors import TridentError
from orchestrator.metrics.memory import grew_past, resident_gib

logger = logging.getLogger("orchestrator")
MEMORY_CHECK_EVERY = 256  # tasks read between two looks at the process's resident memory


class Tasks(Protocol):
    """An environment's tasks by position, finite (``size`` of them) or a stream (``size`` None). A checkpoint part:
    its state is the task the run goes on from (none for a finite taskset, which every step may draw from whole)."""

    size: int | None

    def __getitem__(self, position: int) -> Any: ...

    @property
    def held(self) -> int:
        """How many tasks it holds in memory."""
        ...

    def release(self, below: int) -> None:
        """Drop the tasks before position ``below``: no step draws one any more."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TaskList:
    """A finite taskset, held whole: every step may draw any of its tasks, so it releases none and has no state."""

    def __init__(self, tasks: list):
        self.tasks, self.size = tasks, len(tasks)

    def __getitem__(self, position: int) -> Any:
        return self.tasks[position]

    @property
    def held(self) -> int:
        return self.size

    def release(self, below: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class TaskStream:
    """The tasks of ``open_tasks()`` (a fresh read of the taskset from its first task each call), read as far as
    the positions asked for. Positions below :meth:`release`'s mark are not kept; asking for one again reads the
    taskset from its start (a verifiers taskset cannot seek), as :meth:`resume_at` reads up to a resumed run's.
    Holding more than ``max_held`` tasks, or one read (of a step's window, or up to a resumed run's position)
    growing this process's resident memory by more than ``max_gib`` GiB, is an error naming environment ``name``."""

    def __init__(self, name: str, open_tasks: Callable[[], Iterable], max_held: int, max_gib: float):
        self.name, self.open_tasks, self.max_held, self.max_gib = name, open_tasks, max_held, max_gib
        self.size = None
        self.reader: Iterator | None = None
        self.next = 0  # position of the task the reader yields next
        self.kept: deque = deque()  # the tasks of positions next - len(kept) to next - 1
        self.low = 0  # positions below it are not kept
        self.reads = 0  # times the taskset was read from its start

    def __getitem__(self, position: int):
        if self.reader is None or position < self.next - len(self.kept):  # not held, and read past: read again
            self.reader, self.next = iter(self.open_tasks()), 0
            self.kept.clear()
            self.reads += 1
            if self.reads > 1:
                logger.info(
                    f"environment {self.name!r}: reading its task stream again from its start up to task {position}"
                )
        self.low = min(self.low, position)
        if self.next <= position:
            self.read_to(position)
        return self.kept[position - (self.next - len(self.kept))]

    def read_to(self, position: int) -> None:
        """Read the tasks up to ``position``, holding those from ``low`` on, within ``max_held`` tasks and growing
        resident memory by ``max_gib`` at most (looked at every :data:`MEMORY_CHECK_EVERY` tasks and at the end)."""
        start, first = resident_gib(), self.next
        while self.next <= position:
            try:
                task = next(self.reader)
            except StopIteration:
                raise TridentError(
                    f"environment {self.name!r}: its task stream ended after {self.next} tasks, and the run draws "
                    f"task {position}: raise [[env]] max_tasks above {self.next} to use it as a finite taskset"
                ) from None
            if self.next >= self.low:
                self.kept.append(task)
                if len(self.kept) > self.max_held:
                    raise TridentError(
                        f"environment {self.name!r}: its task stream holds more than max_tasks = {self.max_held} "
                        "tasks the run may still draw: raise [[env]] max_tasks or lower difficulty_pool.stream_window"
                    )
            self.next += 1
            looked = self.next > position or (self.next - first) % MEMORY_CHECK_EVERY == 0
            if looked and grew_past(start, self.max_gib):
                raise TridentError(
                    f"environment {self.name!r}: reading its task stream up to task {self.next - 1} took more than "
                    f"{self.max_gib:g} GiB of memory ({self.next - first} tasks read, {len(self.kept)} held): raise "
                    "[[env]] max_load_gib, or lower difficulty_pool.stream_window or the step's prompts"
                )

    def resume_at(self, position: int) -> None:
        """Go on from ``position``, as a resumed run does: no task before it is kept, and the task there is read now.
        A verifiers taskset cannot seek: the tasks before it are read (once) and dropped."""
        self.release(position)
        if position:
            logger.info(
                f"environment {self.name!r}: reading its task stream up to task {position}, where the resumed run "
                "goes on (a verifiers taskset cannot seek)"
            )
        self[position]

    def release(self, below: int) -> None:
        """Keep no task before position ``below``: no step can draw one any more."""
        self.low = max(self.low, below)
        while self.kept and self.next - len(self.kept) < self.low:
            self.kept.popleft()

    @property
    def held(self) -> int:
        return len(self.kept)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream goes on (the mark :meth:`release` set) and the key of the task there (verifiers'
        ``Task.key``, by default a hash of its data), which a resumed run must read there."""
        return {"position": self.low, "task": self[self.low].key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state['position']`` (:meth:`resume_at`); raise :class:`CannotResume` unless the task there is
        ``state['task']`` (None: not recorded), as a ``load()`` that gives other tasks on another read would not."""
        self.resume_at(state["position"])
        if state["task"] is not None and self[state["position"]].key != state["task"]:
            raise CannotResume(
                f"environment {self.name!r}'s task stream yields another task at position {state['position']} than "
                "the checkpointed run read there (other args, or a load() that gives other tasks on another read: "
                "seeded by the clock, a feed that moved), so the resumed run would not draw what the run drew. Use "
                "the checkpointed run's args, or start from scratch."
            )


def read_tasks(name: str, open_tasks: Callable[[], Iterable], endless: bool, max_tasks: int, max_gib: float) -> Tasks:
    """Environment ``name``'s tasks: a :class:`TaskStream` when its taskset says it is ``endless`` or yields more
    than ``max_tasks`` tasks, else a :class:`TaskList` of all of them, read now. Reading that grows this process's
    resident memory by more than ``max_gib`` GiB stops with one line naming the environment."""
    if endless:
        return TaskStream(name, open_tasks, max_tasks, max_gib)
    tasks, start = [], resident_gib()
    for task in open_tasks():
        if len(tasks) == max_tasks:
            logger.info(
                f"environment {name!r}: its taskset yields more than max_tasks = {max_tasks} tasks: it is read as a "
                "stream, in its own order (docs/environments.md#task-streams)"
            )
            return TaskStream(name, open_tasks, max_tasks, max_gib)
        tasks.append(task)
        if len(tasks) % MEMORY_CHECK_EVERY == 0 and grew_past(start, max_gib):
            raise TridentError(
                f"environment {name!r}: reading its tasks took more than {max_gib:g} GiB of memory ({len(tasks)} "
                f"tasks read); an endless or huge taskset is read as a stream past [[env]] max_tasks = {max_tasks}: "
                f"lower it (or raise [[env]] max_load_gib)"
            )
    return TaskList(tasks)
