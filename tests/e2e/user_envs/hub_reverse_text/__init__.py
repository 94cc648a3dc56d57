"""hub-reverse-text: shaped as verifiers' reverse-text example. Its tasks come from a hub dataset its own ``load()``
names (the id and split are config fields, as there); the reward is the similarity of the tagged answer to the
prompt reversed, and one turn is all the model gets."""

import re
from difflib import SequenceMatcher

import verifiers.v1 as vf

INSTRUCTIONS = "Write the text backwards, character by character, inside <reversed_text></reversed_text>."
ANSWER = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)


class ReversalData(vf.TaskData):
    answer: str


class ReversalTask(vf.Task[ReversalData]):
    @vf.stop
    async def answered_once(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        found = ANSWER.search(trace.last_reply or "")
        return SequenceMatcher(None, found.group(1).strip() if found else "", self.data.answer).ratio()


class ReversalConfig(vf.TasksetConfig):
    dataset_name: str = "PrimeIntellect/Reverse-Text-RL"
    dataset_split: str = "train"


class ReversalTaskset(vf.Taskset[ReversalTask, ReversalConfig]):
    def load(self) -> list[ReversalTask]:
        from datasets import load_dataset

        rows = load_dataset(self.config.dataset_name, split=self.config.dataset_split)
        data = (ReversalData(idx=i, prompt=r["prompt"], system_prompt=INSTRUCTIONS, answer=r["prompt"][::-1])
                for i, r in enumerate(rows))  # fmt: skip
        return [ReversalTask(d, self.config.task) for d in data]


__all__ = ["ReversalTaskset"]
