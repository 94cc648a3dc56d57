"""hub-gsm8k: shaped as verifiers' gsm8k example. Its ``load()`` reads the hub's "openai/gsm8k", config "main", the
split its config names, and keeps the number after "####" as the answer. Unlike the example, the reward compares
numbers here, in the process (the example runs a uv script in the rollout's runtime, which needs the network)."""

import re
from typing import Literal

import verifiers.v1 as vf

INSTRUCTIONS = "Solve the problem step by step; end with the answer alone on a last line, as '#### <number>'."
FINAL = re.compile(r"####\s*(-?[\d,.]+)")


class MathData(vf.TaskData):
    answer: str


class MathTask(vf.Task[MathData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = FINAL.findall(trace.last_reply or "")
        return float(bool(found) and found[-1].replace(",", "").rstrip(".") == self.data.answer.replace(",", ""))


class MathConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "test"


class MathTaskset(vf.Taskset[MathTask, MathConfig]):
    def load(self) -> list[MathTask]:
        from datasets import load_dataset

        rows = load_dataset("openai/gsm8k", "main", split=self.config.split)
        return [
            MathTask(MathData(idx=i, prompt=f"{INSTRUCTIONS}\n\n{row['question']}", answer=final_answer(row["answer"])),
                     self.config.task)
            for i, row in enumerate(rows)
        ]  # fmt: skip


def final_answer(solution: str) -> str:
    return solution.split("####")[-1].strip()


__all__ = ["MathTaskset"]
