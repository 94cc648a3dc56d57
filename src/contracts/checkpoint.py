"""What both processes' checkpointers share: a checkpoint is made of parts that each give and take their own state
(:class:`Stateful`, as torch's modules, optimizers and schedulers do), written after the steps :func:`checkpoint_due`
names; a part that cannot go on from a saved state says why (:class:`CannotResume`). No torch: the orchestrator's
parts are plain data. Where each process's part of ``checkpoints/step_N/`` lies is :mod:`contracts.run_dir`.
"""

from typing import Any, Protocol

from contracts.errors import TridentError
from contracts.shared_config import CkptConfig


class Stateful(Protocol):
    """A part of a checkpoint: it gives its state, and takes back what it gave (in a fresh process, after a restart)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CannotResume(TridentError):
    """A part's saved state does not fit this run (the checkpointer adds which checkpoint)."""


def checkpoint_due(ckpt: CkptConfig | None, step: int, max_steps: int) -> bool:
    """Whether a checkpoint is written after ``step``: every ``ckpt.interval`` steps and after the last one."""
    return ckpt is not None and (step % ckpt.interval == 0 or step == max_steps)
