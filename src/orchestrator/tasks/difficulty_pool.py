"""A difficulty pool: tasks drawn by their recent pass rate, favouring those the policy neither always nor never
solves (a curriculum, as prime-rl's difficulty pools; see docs/losses.md).

A task's pass rate is an exponential moving average of its groups' mean reward, clipped to [0, 1] (the share of
rollouts that pass, for a 0/1 reward). Step N draws by the results of the steps before N - 1: those are known
whenever step N's groups start, even when they start during step N - 1 (``overlap_steps``), so the draw does not
depend on timing and a resumed run draws as the first would have.
"""

PassRates = list[dict[int, float]]  # per environment: task index -> pass rate, for the tasks seen


def task_weight(pass_rate: float | None, min_weight: float) -> float:
    """``max(min_weight, 4 p (1 - p))`` for pass rate ``p``: 1 at p = 0.5, ``min_weight`` for a task always or never
    solved; 1 for a task not seen yet."""
    if pass_rate is None:
        return 1.0
    return max(min_weight, 4 * pass_rate * (1 - pass_rate))


class DifficultyPool:
    """Pass rates of the tasks of each environment (``sizes[e]`` tasks; None: a stream), and the weights they give
    each step."""

    def __init__(self, sizes: list[int | None], ema: float, min_weight: float):
        self.sizes, self.ema, self.min_weight = sizes, ema, min_weight
        self.pass_rates: PassRates = [{} for _ in sizes]
        self.pending: dict[int, list[tuple[int, int, float]]] = {}  # step -> its results, not yet in pass_rates

    def record(self, step: int, results: list[tuple[int, int, float]]) -> None:
        """The groups step ``step`` sampled, in order: ``(environment, task, mean reward)`` each."""
        self.pending[step] = list(results)

    def weights(self, step: int, windows: list[range] | None = None) -> list[list[float]]:
        """Each environment's task weights for step ``step``, by the pass rates after the steps before ``step - 1``:
        of the tasks of its window (default: all ``sizes[e]``). A stream's windows only move forward: the pass rates
        of its tasks before this one are forgotten, so the pool holds at most a window's."""
        for done in sorted(s for s in self.pending if s < step - 1):
            for env, task, reward in self.pending.pop(done):
                self.update(env, task, reward)
        windows = windows or [range(size) for size in self.sizes]
        for rates, size, window in zip(self.pass_rates, self.sizes, windows, strict=True):
            if size is None:
                for task in [task for task in rates if task < window.start]:
                    del rates[task]
        return [
            [task_weight(rates.get(task), self.min_weight) for task in window]
            for rates, window in zip(self.pass_rates, windows, strict=True)
        ]

    def update(self, env: int, task: int, reward: float) -> None:
        """Move the task's pass rate towards ``reward`` (clipped to [0, 1]) by ``ema``; its first result sets it."""
        reward = min(1.0, max(0.0, reward))
        rates = self.pass_rates[env]
        rates[task] = reward if task not in rates else (1 - self.ema) * rates[task] + self.ema * reward

    def state_dict(self) -> dict:
        """The pool's state as JSON-ready data: pass rates and the results not yet counted in them."""
        return {
            "pass_rates": [{str(task): rate for task, rate in rates.items()} for rates in self.pass_rates],
            "pending": {str(step): [list(result) for result in results] for step, results in self.pending.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` gave (floats survive JSON exactly)."""
        self.pass_rates = [{int(task): rate for task, rate in rates.items()} for rates in state["pass_rates"]]
        self.pending = {int(step): [tuple(r) for r in results] for step, results in state["pending"].items()}
