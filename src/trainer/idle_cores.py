"""On the CPU, the trainer takes the cores the inference server leaves idle (``borrow_idle_cores``).

``rl`` gives each process one torch thread: the trainer, the orchestrator and the server share the cores. The server
has nothing to generate once the orchestrator waits for the weights the trainer is making. With ``async_level`` a,
step M's rollouts may come from weights M - 1 - a or newer, so while the trainer trains step N (its result weights
N), the orchestrator can write batches up to step N + a and no further: once that batch is on disk (near the run's
end, its last batch), the server is idle until the step's weights come. From then until the step ends the trainer
runs on every core it may use (its share of them with several ranks on the machine), and goes back to its own thread
after. It looks for the batch before each decoder layer's forward and backward pass, a ``stat`` each time.
"""

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from contracts.run_dir import rollouts_dir


class IdleCores:
    """Widens the trainer's torch threads from ``own`` to ``wide`` once, within a step, the batch of step
    ``step + async_level`` (at most ``max_steps``) is on disk under ``output_dir``; ``widened_s`` is how long the
    last step ran wide."""

    def __init__(self, output_dir: Path, async_level: int, max_steps: int, own: int, wide: int):
        self.output_dir, self.async_level, self.max_steps = Path(output_dir), async_level, max_steps
        self.own, self.wide = own, wide
        self.due: Path | None = None  # the batch to look for, within a step
        self.widened_at: float | None = None
        self.widened_s = 0.0

    @classmethod
    def install(
        cls, model: nn.Module, layers: nn.ModuleList, output_dir: Path, async_level: int | None, max_steps: int
    ) -> "IdleCores | None":
        """An ``IdleCores`` looking before each of ``layers``' passes, or None where no core can be borrowed: a model
        not on the CPU, no ``async_level`` known (a trainer started alone, without ``rl``'s run spec), or no core
        beyond its own thread."""
        if async_level is None or next(model.parameters()).device.type != "cpu":
            return None
        own = torch.get_num_threads()
        wide = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if wide <= own:
            return None
        idle = cls(output_dir, async_level, max_steps, own, wide)
        for layer in layers:
            layer.register_forward_pre_hook(lambda module, args: idle.look())
            layer.register_forward_hook(idle._look_in_backward)
        return idle

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Within training step ``step``: widen once its batch ``step + async_level`` is on disk; back after."""
        last = min(step + self.async_level, self.max_steps)
        self.due, self.widened_at, self.widened_s = rollouts_dir(self.output_dir, last), None, 0.0
        self.look()
        try:
            yield
        finally:
            self.due = None
            if self.widened_at is not None:
                torch.set_num_threads(self.own)
                self.widened_s = time.perf_counter() - self.widened_at

    def look(self) -> None:
        """Widen if the step's last batch the orchestrator may write before its weights is on disk."""
        if self.due is not None and self.widened_at is None and self.due.exists():
            torch.set_num_threads(self.wide)
            self.widened_at = time.perf_counter()

    def _look_in_backward(self, module: nn.Module, args, output) -> None:
        """A hook on the layer's output: look again when the backward pass reaches the layer."""
        hidden = output if isinstance(output, Tensor) else output[0]
        if isinstance(hidden, Tensor) and hidden.requires_grad and self.due is not None and self.widened_at is None:
            hidden.register_hook(lambda grad: self.look())
