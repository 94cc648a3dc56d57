"""Which tasks each step samples: every environment gives its share of the batch, from its own seeded task order.

Step N's prompts are a pure function of N (no state to save beyond the step), so a resumed run continues the order.
"""

import random


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


class TaskOrder:
    """Each environment's tasks shuffled with ``seed``; step N takes the next ``counts[e]`` of environment e's,
    wrapping around when they run out."""

    def __init__(self, tasks_per_env: list[list], counts: list[int], seed: int):
        self.tasks = [list(tasks) for tasks in tasks_per_env]
        for tasks in self.tasks:
            random.Random(seed).shuffle(tasks)
        self.counts = counts

    def __len__(self) -> int:
        return sum(map(len, self.tasks))

    def batch(self, step: int) -> list[tuple[int, object]]:
        """(environment index, task) of each prompt of step ``step``."""
        return [
            (e, tasks[(step * count + i) % len(tasks)])
            for e, (tasks, count) in enumerate(zip(self.tasks, self.counts, strict=True))
            for i in range(count)
        ]
