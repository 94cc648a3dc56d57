"""Trainer checkpoints: model, optimizer, scheduler, RNG and step, written so a run resumes exactly (one
:class:`Checkpointer` over parts that each give and take their own state).

``checkpoints/step_N/trainer/`` holds the sharded model and optimizer state (``torch.distributed.checkpoint``,
one file per rank, reloadable on any number of ranks), ``state.pt`` (step and scheduler) and one RNG file per
rank. Every rank writes into ``.trainer.tmp``; rank 0 marks it ``STABLE`` once it is on the disk and renames it
into place, so a checkpoint part is complete or absent, also after a full disk or a crash.
"""

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from contracts.atomic_io import disk_full, free_space, move_into_place
from contracts.checkpoint import Stateful
from contracts.errors import TridentError, first_line
from contracts.run_dir import checkpoint_dir, complete_checkpoints, mark_stable, step_dirs
from trainer.parallel import World

logger = logging.getLogger("trainer")


class CheckpointError(TridentError):
    """A checkpoint could not be written."""


class ModelAndOptimizer:
    """The sharded part: the model's and the optimizer's state, each rank its shard (``torch.distributed.checkpoint``
    reads it back on any number of ranks)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class RandomState:
    """Each rank's own part: its random number generators' state (the CPU's, and its GPU's on CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"cpu": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


class Checkpointer:
    """The trainer's part of each checkpoint, over parts that each give and take their own state: the sharded one
    (:class:`ModelAndOptimizer`), rank 0's (the scheduler, in ``state.pt`` beside the step and the world size) and
    each rank's own (:class:`RandomState`, ``rng_R.pt``, restored only on as many ranks as wrote it). Every rank
    calls :meth:`save` and :meth:`load`."""

    def __init__(
        self,
        output_dir: Path,
        world: World,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ):
        self.output_dir, self.world = output_dir, world
        self.sharded: Stateful = ModelAndOptimizer(model, optimizer)
        self.shared: dict[str, Stateful] = {"scheduler": scheduler}
        self.per_rank: Stateful = RandomState(world.device)

    def save(self, step: int) -> Path:
        """Write the trainer's state after ``step`` optimizer steps. Returns the folder."""
        world = self.world
        folder = checkpoint_dir(self.output_dir, step) / "trainer"
        tmp = folder.with_name(".trainer.tmp")
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a writer that was killed
            tmp.mkdir(parents=True)
        dist.barrier()
        sharded = self.sharded.state_dict()
        try:
            dcp.save(sharded, checkpoint_id=tmp)
            torch.save(self.per_rank.state_dict(), tmp / f"rng_{world.rank}.pt")
            dist.barrier()
            if world.is_main:
                shared = {name: part.state_dict() for name, part in self.shared.items()}
                torch.save({"step": step, **shared, "world_size": world.size}, tmp / "state.pt")
                mark_stable(tmp)
                move_into_place(tmp, folder)
        except (Exception, CheckpointException) as e:  # dcp's CheckpointException is a BaseException
            full = disk_full(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"could not write checkpoint {folder}: {'no space left on the disk' if full else root_cause(e)} "
                f"({free_space(folder.parent)} free); nothing of it was kept and older checkpoints are intact "
                "(free space, then resume with --ckpt.resume-step -1)"
            ) from e
        dist.barrier()
        return folder

    def load(self, step: int) -> None:
        """Restore the state saved after ``step`` optimizer steps into the freshly built parts."""
        folder = checkpoint_dir(self.output_dir, step) / "trainer"
        sharded = self.sharded.state_dict()  # what to read, and where
        dcp.load(sharded, checkpoint_id=folder)
        self.sharded.load_state_dict(sharded)
        saved = torch.load(folder / "state.pt", weights_only=False)
        for name, part in self.shared.items():
            part.load_state_dict(saved[name])
        rng_path = folder / f"rng_{self.world.rank}.pt"
        if saved["world_size"] == self.world.size and rng_path.exists():
            self.per_rank.load_state_dict(torch.load(rng_path, weights_only=False))
        logger.info(f"resumed from {folder} (step {saved['step']})")


def root_cause(error: BaseException) -> str:
    """One line for what failed: a checkpoint exception's first failure, else the innermost cause."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {first_line(str(error)) or 'no detail'}"


def prune_checkpoints(output_dir: Path, keep: int | None) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep`` (and any partial one older than those)."""
    steps = complete_checkpoints(output_dir)
    if keep is None or len(steps) <= keep:
        return []
    oldest_kept = steps[-keep]
    removed = [path for step, path in step_dirs(Path(output_dir) / "checkpoints").items() if step < oldest_kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
