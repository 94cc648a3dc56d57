"""Which tasks each step samples: every environment gives its share of the batch, from its own seeded task order
or, with ``[difficulty_pool]``, drawn by the tasks' recent pass rates; and which task replaces a group that
``[filter]`` refills.

A task is named by ``(environment index, position in its taskset)``. Without the pool, step N's prompts are a pure
function of N (no state to save beyond the step), so a resumed run continues the order.

A task stream (:class:`~orchestrator.tasks.stream.TaskStream`, size None) is drawn from a window of its positions that
moves forward with the steps (:meth:`TaskSampler.window`): in stream order, its replacements from the window's
positions after the step's own; with the pool, by weight from the window. Nothing before a step's window is drawn
again, so the stream need hold only the window.
"""

import heapq
import logging
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts.checkpoint import CannotResume
from orchestrator.tasks.difficulty_pool import DifficultyPool
from orchestrator.tasks.stream import Tasks

logger = logging.getLogger("orchestrator")


def draw(weights: Sequence[float], k: int, rng: random.Random, exclude: Collection[int] = ()) -> list[int]:
    """``k`` indices of ``weights`` (all > 0) drawn without replacement, each in proportion to its weight among those
    not yet drawn (Efraimidis and Spirakis' keys ``u ** (1 / w)``: the same as ``k`` draws one after another), leaving
    out ``exclude`` while enough others remain. Past ``len(weights)`` the draw starts again over all of them."""
    left = [i for i in range(len(weights)) if i not in exclude]
    if len(left) < k:
        left = list(range(len(weights)))
    chosen: list[int] = []
    while len(chosen) < k:
        keys = {i: rng.random() ** (1 / weights[i]) for i in left}
        chosen += heapq.nlargest(k - len(chosen), left, key=keys.__getitem__)
    return chosen


class TaskOrder:
    """Each environment's task indices shuffled with ``seed``; step N (from 1) takes the N-th ``counts[e]`` of
    environment e's, wrapping around when they run out. A stream's (size None) are ``0 .. counts[e] - 1``: the first
    of its window."""

    def __init__(self, sizes: list[int | None], counts: list[int], seed: int):
        self.order = [None if size is None else list(range(size)) for size in sizes]
        for order in self.order:
            if order is not None:
                random.Random(seed).shuffle(order)
        self.counts = counts

    def batch(self, step: int) -> list[tuple[int, int]]:
        """(environment index, task index) of each prompt of step ``step``."""
        return [
            (e, i if order is None else order[((step - 1) * count + i) % len(order)])
            for e, (order, count) in enumerate(zip(self.order, self.counts, strict=True))
            for i in range(count)
        ]


@dataclass(frozen=True)
class StepTasks:
    """The tasks of one step: ``(environment, task)`` of each group, and each environment's task weights that a
    replacement group is drawn by: weight ``i`` is task ``offsets[e] + i``'s (a stream's window starts at its
    offset; a finite taskset's at 0)."""

    step: int
    seed: int
    tasks: list[tuple[int, int]]
    weights: list[list[float]]
    offsets: list[int] | None = None  # None: all 0
    orders: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)  # replacements, drawn once

    def replacement(self, slot: int, attempt: int, tried: Collection[int]) -> tuple[int, int]:
        """The task of the ``attempt``-th replacement (from 1) of the group in place ``slot``, from the same
        environment: a pure function of the seed, step, slot and attempt, whatever order the places finish in.

        A step's replacements are different tasks, none of them the step's own: they are taken from one weighted draw
        of the environment's other tasks (:meth:`replacement_order`), the first replacements of its places first (in
        the order of the places), then the second ones, and so on. Past the draw's end (an environment with fewer
        other tasks than its places ask for), a replacement is drawn by weight leaving out the step's own tasks and
        this place's ``tried`` ones while others remain: it may repeat another place's."""
        env = self.tasks[slot][0]
        offset = self.offset(env)
        places = [place for place, (e, _) in enumerate(self.tasks) if e == env]
        position = (attempt - 1) * len(places) + places.index(slot)
        order = self.replacement_order(env)
        if position < len(order):
            return env, offset + order[position]
        taken = {task - offset for e, task in self.tasks if e == env} | {task - offset for task in tried}
        rng = random.Random(f"{self.seed}:{self.step}:{slot}:{attempt}")
        return env, offset + draw(self.weights[env], 1, rng, taken)[0]

    def offset(self, env: int) -> int:
        return self.offsets[env] if self.offsets else 0

    def replacement_order(self, env: int) -> list[int]:
        """Environment ``env``'s tasks other than the step's own (as indices of its weights), drawn by weight into the
        order replacements take them in (seeded by the seed, step and environment)."""
        if env not in self.orders:
            own = {task - self.offset(env) for e, task in self.tasks if e == env}
            others = len(self.weights[env]) - len(own)
            rng = random.Random(f"{self.seed}:{self.step}:{env}:replacements")
            self.orders[env] = draw(self.weights[env], others, rng, own) if others else []
        return self.orders[env]


class TaskSampler:
    """The tasks of each step: environment e gives ``counts[e]`` of its ``sizes[e]`` tasks (None: a stream), in the
    seeded order, or, with a ``pool``, drawn by the pool's weights for that step. A stream's window holds
    ``attempts`` (``[filter] max_attempts`` with refill, else 1) times its count of positions, or with the pool
    ``stream_window`` (at least its count)."""

    def __init__(
        self,
        sizes: list[int | None],
        counts: list[int],
        seed: int,
        pool: DifficultyPool | None = None,
        attempts: int = 1,
        stream_window: int = 0,
    ):
        self.sizes, self.counts, self.seed, self.pool = sizes, counts, seed, pool
        self.attempts, self.stream_window = attempts, stream_window
        self.order = TaskOrder(sizes, counts, seed)

    @property
    def num_tasks(self) -> int:
        """Tasks of the finite tasksets, together."""
        return sum(size for size in self.sizes if size is not None)

    def window(self, env: int, step: int) -> range:
        """The positions environment ``env``'s tasks are drawn from for step ``step``: all of a finite taskset's; of
        a stream, a window moved forward by the positions a step uses (by ``counts[env]`` with the pool)."""
        size, count = self.sizes[env], self.counts[env]
        if size is not None:
            return range(size)
        if self.pool is None:
            return range((step - 1) * count * self.attempts, step * count * self.attempts)
        return range((step - 1) * count, (step - 1) * count + max(self.stream_window, count))

    def windows(self, step: int) -> list[range]:
        """Each environment's :meth:`window` for step ``step``."""
        return [self.window(e, step) for e in range(len(self.sizes))]

    def stream_positions(self, step: int) -> list[int | None]:
        """Where each stream's window begins after step ``step`` (None for a finite taskset): nothing before it is
        drawn again."""
        windows = self.windows(step + 1)
        return [None if size is not None else window.start for size, window in zip(self.sizes, windows, strict=True)]

    def step_tasks(self, step: int) -> StepTasks:
        """The tasks of step ``step`` (a pure function of the step and, with the pool, of its state)."""
        windows = self.windows(step)
        offsets = [window.start for window in windows]
        if self.pool is None:
            weights = [[1.0] * len(window) for window in windows]
            tasks = [(e, offsets[e] + task) for e, task in self.order.batch(step)]
            return StepTasks(step, self.seed, tasks, weights, offsets)
        weights = self.pool.weights(step, windows)
        rng = random.Random(f"{self.seed}:{step}")
        tasks = [(e, offsets[e] + task) for e, count in enumerate(self.counts) for task in draw(weights[e], count, rng)]
        return StepTasks(step, self.seed, tasks, weights, offsets)


class TaskFeed:
    """The run's tasks: each environment's (``per_env``), the ``sampler`` that draws each step's, and the steps done
    (:meth:`finish`). A checkpoint part: its state is where in the data the run is and what fixes the order (the
    sampler's seed and shares, where each stream's window begins), the difficulty pool's, and the task each stream
    goes on from, which a resumed run must read there (but after ``last_step``: a stream may end where the run does).
    """

    def __init__(self, per_env: list[Tasks], sampler: TaskSampler, last_step: int):
        self.per_env, self.sampler, self.last_step = per_env, sampler, last_step
        self.step = 0  # steps whose batch is written

    def finish(self, step: int) -> None:
        """Step ``step``'s batch is written: each stream drops the tasks no later step can draw."""
        self.step = step
        for tasks, window in zip(self.per_env, self.sampler.windows(step + 1), strict=True):
            tasks.release(window.start)

    def order(self, step: int) -> dict[str, Any]:
        """What fixes the task order up to step ``step``: a resumed run must have the same."""
        sampler = self.sampler
        order = {"num_tasks": sampler.num_tasks, "seed": sampler.seed, "prompts_per_env": sampler.counts}
        positions = sampler.stream_positions(step)
        return order | ({"stream_positions": positions} if any(at is not None for at in positions) else {})

    def state_dict(self) -> dict[str, Any]:
        step, pool = self.step, self.sampler.pool
        state = {"step": step, "tasks_consumed": step * sum(self.sampler.counts), **self.order(step)}
        if pool is not None:
            state["difficulty_pool"] = pool.state_dict()
        if "stream_positions" in state and step < self.last_step:
            state["stream_tasks"] = [tasks.state_dict().get("task") for tasks in self.per_env]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on after ``state['step']``; raise :class:`CannotResume` unless this run has the checkpointed run's task
        order and its streams yield the tasks it read where the run goes on."""
        step, expected = state["step"], self.order(state["step"])
        saved = {"prompts_per_env": expected["prompts_per_env"]} | state  # checkpoints before environment shares
        changed = [
            f"{key} {saved.get(key)} -> {expected.get(key)}"
            for key in ("num_tasks", "seed", "prompts_per_env", "stream_positions")  # the last: absent without streams
            if saved.get(key) != expected.get(key)
        ]
        if changed:
            raise CannotResume(
                f"the task order changed ({', '.join(changed)}); resuming would repeat or skip prompts. Use the "
                "environments and seed of the checkpointed run, or start from scratch."
            )
        keys = state.get("stream_tasks", [None] * len(self.per_env))
        for tasks, at, key in zip(self.per_env, self.sampler.stream_positions(step), keys, strict=True):
            if at is not None:
                tasks.load_state_dict({"position": at, "task": key})
        self.step = step
        logger.info(f"resuming after step {step}: prompts from task {step * sum(self.sampler.counts)} on")
        pool = self.sampler.pool
        if pool is not None and "difficulty_pool" in state:
            pool.load_state_dict(state["difficulty_pool"])
            logger.info(f"difficulty pool restored: pass rates of {sum(map(len, pool.pass_rates))} tasks")
        elif pool is not None:
            logger.warning(f"the checkpoint of step {step} has no difficulty pool: it starts with no pass rates")
