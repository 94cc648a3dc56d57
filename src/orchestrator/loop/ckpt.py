"""The orchestrator's part of a checkpoint: where in the data the run is, so a resumed run continues the order.

Step N's prompts are a pure function of N over the seeded task order (:meth:`Orchestrator.batch_tasks`) and no
rollout outlives the batch it was written in, so the state is the step and what fixes the order; with
``[difficulty_pool]``, also the pool's pass rates, which the draw of later steps depends on.
"""

import json
from pathlib import Path

from contracts.atomic_io import atomic_dir
from contracts.errors import TridentError
from contracts.run_dir import checkpoint_dir, mark_stable

STATE_FILE = "state.json"


def data_state(
    step: int,
    batch_size: int,
    num_tasks: int,
    seed: int,
    prompts_per_env: list[int],
    pool: dict | None = None,
    stream_positions: list[int | None] | None = None,
) -> dict:
    """What the checkpoint of ``step`` records: the step, the data position, what fixes the task order, the
    difficulty pool's state (``pool``, when there is one) and, with a task stream, where each stream's next step
    reads from (``stream_positions``, None for a finite taskset)."""
    state = {"step": step, "tasks_consumed": step * batch_size, "num_tasks": num_tasks, "seed": seed,
             "prompts_per_env": prompts_per_env}  # fmt: skip
    if stream_positions is not None and any(position is not None for position in stream_positions):
        state["stream_positions"] = stream_positions
    return state | ({"difficulty_pool": pool} if pool is not None else {})


def save_state(output_dir: Path, state: dict) -> Path:
    """Write the orchestrator's part of the checkpoint of ``state['step']`` atomically, ``STABLE`` last."""
    folder = checkpoint_dir(output_dir, state["step"]) / "orchestrator"
    with atomic_dir(folder) as tmp:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        mark_stable(tmp)
    return folder


def state_path(output_dir: Path, step: int) -> Path:
    return checkpoint_dir(output_dir, step) / "orchestrator" / STATE_FILE


def read_state(output_dir: Path, step: int) -> dict:
    """The orchestrator's part of the checkpoint of ``step``, as :func:`save_state` wrote it."""
    return json.loads(state_path(output_dir, step).read_text())


def check_resumable(output_dir: Path, expected: dict) -> None:
    """Raise unless the checkpoint of ``expected['step']`` had the same task order as this run."""
    path = state_path(output_dir, expected["step"])
    saved = read_state(output_dir, expected["step"])
    saved.setdefault("prompts_per_env", expected["prompts_per_env"])  # checkpoints before environment shares
    changed = [
        f"{key} {saved.get(key)} -> {expected.get(key)}"
        for key in ("num_tasks", "seed", "prompts_per_env", "stream_positions")  # the last: absent without streams
        if saved.get(key) != expected.get(key)
    ]
    if changed:
        raise TridentError(
            f"cannot resume from {path}: the task order changed ({', '.join(changed)}); resuming would repeat or "
            "skip prompts. Use the environments and seed of the checkpointed run, or start from scratch."
        )


def check_stream_tasks(output_dir: Path, step: int, envs: list[str], keys: list[str | None]) -> None:
    """Raise unless each task stream yields, where the run resumed from the checkpoint of ``step`` goes on, the task
    the checkpointed run read there (``keys``: each environment's task key there, None for a finite taskset): a
    ``load()`` that gives other tasks on another read would make the resumed run draw others. A checkpoint that
    recorded none passes."""
    saved = read_state(output_dir, step)
    if "stream_tasks" not in saved:
        return
    for env, position, was, now in zip(envs, saved["stream_positions"], saved["stream_tasks"], keys, strict=True):
        if was != now:
            raise TridentError(
                f"cannot resume from {state_path(output_dir, step)}: environment {env!r}'s task stream yields "
                f"another task at position {position} than the checkpointed run read there (other args, or a load() "
                "that gives other tasks on another read: seeded by the clock, a feed that moved), so the resumed run "
                "would not draw what the run drew. Use the checkpointed run's args, or start from scratch."
            )
