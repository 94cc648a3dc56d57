"""Reading an environment's tasks: a finite taskset is held whole, as a list; an endless one (or one longer than
``[[env]] max_tasks``) is a :class:`TaskStream`, read lazily, holding only the tasks the run can still draw.

Either is indexed by position: task ``i`` is the ``i``-th its ``load()`` yields. Which positions a step draws is
:mod:`~orchestrator.tasks.sampler`'s business; see docs/environments.md#task-streams.
"""

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from contracts.errors import TridentError
from orchestrator.metrics.memory import grew_past, resident_gib

logger = logging.getLogger("orchestrator")
MEMORY_CHECK_EVERY = 256  # tasks read between two looks at the process's resident memory


class TaskStream:
    """The tasks of ``open_tasks()`` (a fresh read of the taskset from its first task each call), read as far as
    the positions asked for. Positions below :meth:`release`'s mark are not kept; asking for one again reads the
    taskset from its start (a verifiers taskset cannot seek), as :meth:`resume_at` reads up to a resumed run's.
    Holding more than ``max_held`` tasks, or one read (of a step's window, or up to a resumed run's position)
    growing this process's resident memory by more than ``max_gib`` GiB, is an error naming environment ``name``."""

    def __init__(self, name: str, open_tasks: Callable[[], Iterable], max_held: int, max_gib: float):
        self.name, self.open_tasks, self.max_held, self.max_gib = name, open_tasks, max_held, max_gib
        self.reader: Iterator | None = None
        self.next = 0  # position of the task the reader yields next
        self.held: deque = deque()  # the tasks of positions next - len(held) to next - 1
        self.low = 0  # positions below it are not kept
        self.reads = 0  # times the taskset was read from its start

    def __getitem__(self, position: int):
        if self.reader is None or position < self.next - len(self.held):  # not held, and read past: read again
            self.reader, self.next = iter(self.open_tasks()), 0
            self.held.clear()
            self.reads += 1
            if self.reads > 1:
                logger.info(
                    f"environment {self.name!r}: reading its task stream again from its start up to task {position}"
                )
        self.low = min(self.low, position)
        if self.next <= position:
            self.read_to(position)
        return self.held[position - (self.next - len(self.held))]

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
                self.held.append(task)
                if len(self.held) > self.max_held:
                    raise TridentError(
                        f"environment {self.name!r}: its task stream holds more than max_tasks = {self.max_held} "
                        "tasks the run may still draw: raise [[env]] max_tasks or lower difficulty_pool.stream_window"
                    )
            self.next += 1
            looked = self.next > position or (self.next - first) % MEMORY_CHECK_EVERY == 0
            if looked and grew_past(start, self.max_gib):
                raise TridentError(
                    f"environment {self.name!r}: reading its task stream up to task {self.next - 1} took more than "
                    f"{self.max_gib:g} GiB of memory ({self.next - first} tasks read, {len(self.held)} held): raise "
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
        while self.held and self.next - len(self.held) < self.low:
            self.held.popleft()


def read_tasks(
    name: str, open_tasks: Callable[[], Iterable], endless: bool, max_tasks: int, max_gib: float
) -> list | TaskStream:
    """Environment ``name``'s tasks: a :class:`TaskStream` when its taskset says it is ``endless`` or yields more
    than ``max_tasks`` tasks, else all of them, read now. Reading that grows this process's resident memory by more
    than ``max_gib`` GiB stops with one line naming the environment."""
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
    return tasks
