"""puzzle-stream: an endless stream of generated sums, written as verifiers' documentation shows a generated taskset.

``load()`` never ends: task ``i`` is built from the seed ``(config.seed, i)`` alone, so the same config always
yields the same stream. Reward: 1 for the exact sum; otherwise half the share of the sum's digits the reply holds, so
even a random model's replies score apart.
"""

import itertools
import random
import re

import verifiers.v1 as vf

from orchestrator.verifiers_adapter.harness import InProcessHarness


def sum_reward(reply: str, answer: str) -> float:
    """1 when the reply's last number is ``answer``; else half the share of ``answer``'s digits found in the reply."""
    numbers = re.findall(r"-?\d+", reply)
    if numbers and numbers[-1] == answer:
        return 1.0
    return 0.5 * sum(digit in reply for digit in answer) / len(answer)


class PuzzleStreamConfig(vf.TasksetConfig):
    terms: int = 3
    """Numbers added in each puzzle."""
    max_term: int = 99
    """Largest number of a puzzle."""
    seed: int = 0
    """Seed of the puzzle generator."""


class PuzzleData(vf.TaskData):
    answer: str


class PuzzleTask(vf.Task[PuzzleData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct_sum(self, task: PuzzleData, trace: vf.Trace) -> float:
        return sum_reward(trace.last_reply, task.answer)


class PuzzleStreamTaskset(vf.Taskset[PuzzleTask, PuzzleStreamConfig]):
    INFINITE = True  # load() yields tasks forever

    def load(self):
        for i in itertools.count():
            rng = random.Random(f"{self.config.seed}:{i}")
            terms = [rng.randint(0, self.config.max_term) for _ in range(self.config.terms)]
            prompt = f"What is {' + '.join(map(str, terms))}? Reply with the number only."
            yield PuzzleTask(PuzzleData(id=f"puzzle-{i}", prompt=prompt, answer=str(sum(terms))), self.config.task)


__all__ = ["InProcessHarness", "PuzzleStreamTaskset", "sum_reward"]
