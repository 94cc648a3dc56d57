"""reverse-text: reverse a string character by character; reward is the similarity to the exact reverse."""

import difflib
import random

import verifiers.v1 as vf

from orchestrator.verifiers_adapter.harness import InProcessHarness

WORDS = (
    "time river stone cloud music paper light green quiet north window garden tiger orbit maple "
    "silver candle rocket forest planet bridge winter summer copper violet"
).split()


def similarity(reply: str, text: str) -> float:
    """difflib's ratio between the reply and the reverse of ``text``, in [0, 1]."""
    return difflib.SequenceMatcher(None, reply.strip(), text[::-1]).ratio()


class ReverseTextConfig(vf.TasksetConfig):
    num_examples: int = 512
    """Strings generated."""
    min_words: int = 1
    max_words: int = 3
    """Each string has between min_words and max_words words."""
    seed: int = 0
    """Seed of the string generator."""


class ReverseTextData(vf.TaskData):
    text: str


class ReverseTextTask(vf.Task[ReverseTextData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def similarity(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return similarity(trace.last_reply, task.text)


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_examples):
            text = " ".join(rng.choices(WORDS, k=rng.randint(self.config.min_words, self.config.max_words)))
            prompt = f"Reverse the following text, character by character: {text}"
            yield ReverseTextTask(ReverseTextData(id=f"reverse-text-{i}", prompt=prompt, text=text), self.config.task)


__all__ = ["InProcessHarness", "ReverseTextTaskset", "similarity"]
