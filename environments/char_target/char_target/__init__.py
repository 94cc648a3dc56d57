"""char-target: reply with characters from a target set (digits by default).

Reward is the share of the reply's characters that belong to the target set: smooth, so even a randomly
initialised model improves it measurably within minutes. Prompts are generated from a seed.
"""

import random

import verifiers.v1 as vf

from orchestrator.verifiers_adapter.harness import InProcessHarness

WORDS = "apple river stone cloud music paper light green quiet north window garden".split()


def target_share(reply: str, target_chars: str) -> float:
    """Share of the reply's non-space characters that are in ``target_chars`` (0 for an empty reply)."""
    chars = [c for c in reply if not c.isspace()]
    return sum(c in target_chars for c in chars) / len(chars) if chars else 0.0


class CharTargetConfig(vf.TasksetConfig):
    num_examples: int = 512
    """Prompts generated."""
    target_chars: str = "0123456789"
    """Characters the reply is rewarded for."""
    seed: int = 0
    """Seed of the prompt generator."""


class CharTargetData(vf.TaskData):
    target_chars: str


class CharTargetTask(vf.Task[CharTargetData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def target_share(self, task: CharTargetData, trace: vf.Trace) -> float:
        return target_share(trace.last_reply, task.target_chars)


class CharTargetTaskset(vf.Taskset[CharTargetTask, CharTargetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_examples):
            words = " ".join(rng.choices(WORDS, k=3))
            prompt = f"Write only characters from {self.config.target_chars!r}, about {words}."
            data = CharTargetData(id=f"char-target-{i}", prompt=prompt, target_chars=self.config.target_chars)
            yield CharTargetTask(data, self.config.task)


__all__ = ["InProcessHarness", "CharTargetTaskset", "target_share"]
