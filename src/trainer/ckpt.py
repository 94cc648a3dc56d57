"""Trainer checkpoints: model, optimizer, scheduler, RNG and step, written so a run resumes exactly.

``checkpoints/step_N/trainer/`` holds the sharded model and optimizer state (``torch.distributed.checkpoint``,
one file per rank, reloadable on any number of ranks), ``state.pt`` (step and scheduler) and one RNG file per
rank. Every rank writes into ``.trainer.tmp``; rank 0 marks it ``STABLE`` once it is on the disk and renames it
into place, so a checkpoint part is complete or absent, also after a full disk or a crash.
"""

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from contracts.atomic_io import disk_full, free_space, move_into_place
from contracts.errors import TridentError, first_line
from contracts.run_dir import checkpoint_dir, complete_checkpoints, mark_stable, step_dirs
from trainer.parallel import World

logger = logging.getLogger("trainer")


class CheckpointError(TridentError):
    """A checkpoint could not be written."""


def rng_state(device: torch.device) -> dict:
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    world: World,
) -> Path:
    """Write the trainer's state after ``step`` optimizer steps; every rank calls it. Returns the folder."""
    folder = checkpoint_dir(output_dir, step) / "trainer"
    tmp = folder.with_name(".trainer.tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a writer that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        torch.save(rng_state(world.device), tmp / f"rng_{world.rank}.pt")
        dist.barrier()
        if world.is_main:
            torch.save({"step": step, "scheduler": scheduler.state_dict(), "world_size": world.size}, tmp / "state.pt")
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


def root_cause(error: BaseException) -> str:
    """One line for what failed: a checkpoint exception's first failure, else the innermost cause."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {first_line(str(error)) or 'no detail'}"


def load_checkpoint(
    output_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    world: World,
) -> None:
    """Restore the state saved after ``step`` optimizer steps into freshly built objects; every rank calls it."""
    folder = checkpoint_dir(output_dir, step) / "trainer"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    saved = torch.load(folder / "state.pt", weights_only=False)
    scheduler.load_state_dict(saved["scheduler"])
    rng_path = folder / f"rng_{world.rank}.pt"
    if saved["world_size"] == world.size and rng_path.exists():
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and world.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], world.device)
    logger.info(f"resumed from {folder} (step {saved['step']})")


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
