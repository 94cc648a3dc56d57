"""The orchestrator's own memory: its resident size, and the bounds on its growth that stop a run with one line
before the machine kills it: while an environment's tasks are read (``[[env]] max_load_gib``, in
:mod:`~orchestrator.tasks.stream`) and from step to step (``max_memory_growth_gib``, :class:`StepMemory`)."""

import os

from contracts.errors import TridentError


def resident_gib() -> float | None:
    """This process's resident memory in GiB (Linux's /proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return None


def grew_past(start: float | None, max_gib: float) -> bool:
    """Whether this process's resident memory grew by more than ``max_gib`` GiB since it was ``start`` (None:
    unknown, never)."""
    return start is not None and resident_gib() - start > max_gib


class StepMemory:
    """The orchestrator's resident memory after each step, which may grow by ``max_growth_gib`` GiB at most from
    the end of this process's first step (which starts the rollouts' clients, caches and pools)."""

    def __init__(self, max_growth_gib: float):
        self.max_growth_gib = max_growth_gib
        self.first: float | None = None

    def after_step(self, step: int, held: list[tuple[str, int]]) -> float | None:
        """The resident memory now (None where it cannot be read); past the bound, a :class:`TridentError` naming
        each environment with the tasks it holds (``held``: its id and count)."""
        now = resident_gib()
        if self.first is None:
            self.first = now
        elif now is not None and now - self.first > self.max_growth_gib:
            holding = ", ".join(f"environment {env!r} holds {count} tasks" for env, count in held)
            raise TridentError(
                f"step {step}: the orchestrator's resident memory grew by {now - self.first:.2f} GiB since its "
                f"first step ({self.first:.2f} -> {now:.2f} GiB), past orchestrator.max_memory_growth_gib = "
                f"{self.max_growth_gib:g} ({holding}): raise it if the run's steps need more"
            )
        return now
