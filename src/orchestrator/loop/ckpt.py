"""The orchestrator's part of a checkpoint: where in the data the run is, so a resumed run continues the order.

Step N's prompts are a pure function of N over the seeded task order (:meth:`Orchestrator.batch_tasks`) and no
rollout outlives the batch it was written in, so the state is the step and what fixes the order; with
``[difficulty_pool]``, also the pool's pass rates, which the draw of later steps depends on; under
``[advantage] baseline = "running"``, the running baselines, which later advantages depend on. Each part gives its
own (:class:`~orchestrator.tasks.sampler.TaskFeed`,
:class:`~orchestrator.batching.running_baseline.RunningBaselines`); this module writes and reads them.
"""

import json
from pathlib import Path
from typing import Any

from contracts.atomic_io import atomic_dir
from contracts.checkpoint import CannotResume, Stateful
from contracts.errors import TridentError
from contracts.run_dir import checkpoint_dir, mark_stable

STATE_FILE = "state.json"


class Checkpointer:
    """The orchestrator's part of each checkpoint: the states of ``parts`` side by side in one JSON file (each part
    its own keys), written whole or not at all; resume is :meth:`load`."""

    def __init__(self, output_dir: Path, parts: list[Stateful]):
        self.output_dir, self.parts = output_dir, parts

    def save(self, step: int) -> Path:
        """Write the parts' state after ``step`` steps atomically, ``STABLE`` last. Returns the folder."""
        state: dict[str, Any] = {}
        for part in self.parts:
            own = part.state_dict()
            assert state.keys().isdisjoint(own), f"two checkpoint parts give {sorted(state.keys() & own.keys())}"
            state |= own
        folder = checkpoint_dir(self.output_dir, step) / "orchestrator"
        with atomic_dir(folder) as tmp:
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            mark_stable(tmp)
        return folder

    def load(self, step: int) -> None:
        """Give each part its state from the checkpoint of ``step``; one that cannot go on from it is one line."""
        saved = read_state(self.output_dir, step)
        for part in self.parts:
            try:
                part.load_state_dict(saved)
            except CannotResume as e:
                raise TridentError(f"cannot resume from {state_path(self.output_dir, step)}: {e}") from None


def state_path(output_dir: Path, step: int) -> Path:
    return checkpoint_dir(output_dir, step) / "orchestrator" / STATE_FILE


def read_state(output_dir: Path, step: int) -> dict:
    """The orchestrator's part of the checkpoint of ``step``, as :meth:`Checkpointer.save` wrote it."""
    return json.loads(state_path(output_dir, step).read_text())
