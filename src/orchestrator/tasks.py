"""Which tasks each step samples: every environment gives its share of the batch, from its own seeded task order
or, with ``[difficulty_pool]``, drawn by the tasks' recent pass rates; and which task replaces a group that
``[filter]`` refills.

A task is named by ``(environment index, index in its taskset)``. Without the pool, step N's prompts are a pure
function of N (no state to save beyond the step), so a resumed run continues the order.
"""

import heapq
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from orchestrator.difficulty_pool import DifficultyPool


def prompts_per_env(shares: list[float], batch_size: int) -> list[int]:
    """How many of a batch's ``batch_size`` prompts each environment gives: in proportion to its share, the
    remaining prompts going to the largest remainders (earlier environments first on ties)."""
    total = sum(shares)
    exact = [batch_size * share / total for share in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: batch_size - sum(counts)]:
        counts[i] += 1
    return counts


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
    environment e's, wrapping around when they run out."""

    def __init__(self, sizes: list[int], counts: list[int], seed: int):
        self.order = [list(range(size)) for size in sizes]
        for order in self.order:
            random.Random(seed).shuffle(order)
        self.counts = counts

    def batch(self, step: int) -> list[tuple[int, int]]:
        """(environment index, task index) of each prompt of step ``step``."""
        return [
            (e, order[((step - 1) * count + i) % len(order)])
            for e, (order, count) in enumerate(zip(self.order, self.counts, strict=True))
            for i in range(count)
        ]


@dataclass(frozen=True)
class StepTasks:
    """The tasks of one step: ``(environment, task)`` of each group, and each environment's task weights that a
    replacement group is drawn by."""

    step: int
    seed: int
    tasks: list[tuple[int, int]]
    weights: list[list[float]]

    def replacement(self, slot: int, attempt: int, tried: Collection[int]) -> tuple[int, int]:
        """The task of the ``attempt``-th replacement (from 1) of the group in place ``slot``: drawn by weight from
        the same environment's tasks, leaving out the step's own and the ``tried`` ones; a pure function of the
        seed, step, slot and attempt."""
        env = self.tasks[slot][0]
        taken = {task for e, task in self.tasks if e == env} | set(tried)
        rng = random.Random(f"{self.seed}:{self.step}:{slot}:{attempt}")
        return env, draw(self.weights[env], 1, rng, taken)[0]


class TaskSampler:
    """The tasks of each step: environment e gives ``counts[e]`` of its ``sizes[e]`` tasks, in the seeded order,
    or, with a ``pool``, drawn by the pool's weights for that step."""

    def __init__(self, sizes: list[int], counts: list[int], seed: int, pool: DifficultyPool | None = None):
        self.sizes, self.counts, self.seed, self.pool = sizes, counts, seed, pool
        self.order = TaskOrder(sizes, counts, seed)

    def __len__(self) -> int:
        return sum(self.sizes)

    def step_tasks(self, step: int) -> StepTasks:
        """The tasks of step ``step`` (a pure function of the step and, with the pool, of its state)."""
        if self.pool is None:
            weights = [[1.0] * size for size in self.sizes]
            return StepTasks(step, self.seed, self.order.batch(step), weights)
        weights = self.pool.weights(step)
        rng = random.Random(f"{self.seed}:{step}")
        tasks = [(e, task) for e, count in enumerate(self.counts) for task in draw(weights[e], count, rng)]
        return StepTasks(step, self.seed, tasks, weights)
