"""gsm8k-calc: grade-school math word problems, solved with a calculator tool.

Problems come from a seeded generator (several templates, 2-4 arithmetic steps, integer answers) or from a
GSM8K-format dataset (``dataset``: a local JSONL or parquet file, or ``openai/gsm8k`` where a hub is reachable).
The model may call ``calculator`` for a few turns, then ends its reply with ``#### <answer>``
(``\\boxed{<answer>}`` and a trailing number are accepted too).

Rewards: ``correct_answer`` (1 if the final answer equals the target) and a small ``tool_use`` term (1 if the
calculator was called at least once with a valid expression). The metric ``calculator_calls`` counts the calls.
"""

import json
from collections.abc import Iterable
from typing import Annotated

import verifiers.v1 as vf
from dataset_rows import TasksetDataset
from pydantic import Field
from reward_weights import with_reward_weights

from gsm8k_calc.answers import is_correct, parse_final_answer
from gsm8k_calc.problems import Problem, generate_problems, load_gsm8k
from gsm8k_calc.tools import CalculatorError, calculator, evaluate
from orchestrator.verifiers_adapter.harness import InProcessHarness

CALCULATOR = "gsm8k_calc.tools:calculator"
DEFAULT_NUM_EXAMPLES = 1024
SYSTEM_PROMPT = (
    "Solve the math word problem step by step. Use the calculator tool for every arithmetic step: call it with an "
    "expression such as (12 + 8) * 3. When you know the answer, end your reply with a last line of the form "
    "'#### 42', giving the final answer as a number only."
)


def calculator_expressions(messages: Iterable[vf.AssistantMessage]) -> list[str | None]:
    """The ``expression`` argument of each calculator call in ``messages``, in order; None where the call's arguments
    are not a JSON object with a string ``expression``."""
    expressions = []
    for message in messages:
        for call in message.tool_calls or []:
            if call.name != calculator.__name__:
                continue
            try:
                arguments = json.loads(call.arguments or "{}")
            except json.JSONDecodeError:
                arguments = None
            expression = arguments.get("expression") if isinstance(arguments, dict) else None
            expressions.append(expression if isinstance(expression, str) else None)
    return expressions


def is_valid_expression(expression: str | None) -> bool:
    """Whether the calculator evaluates ``expression`` without an error."""
    if expression is None:
        return False
    try:
        evaluate(expression)
    except CalculatorError:
        return False
    return True


def tool_use_score(expressions: list[str | None]) -> float:
    """1.0 if at least one calculator call had a valid expression, else 0.0."""
    return float(any(map(is_valid_expression, expressions)))


class Gsm8kCalcConfig(vf.TasksetConfig):
    num_examples: Annotated[int | None, Field(ge=1)] = None
    """Problems generated (1024 when unset); with dataset, its first num_examples rows (all when unset)."""
    seed: int = 0
    """Seed of the problem generator (unused with dataset)."""
    dataset: TasksetDataset = None
    """GSM8K-format rows ('question', and an 'answer' ending in '#### <number>'): a path (local JSONL/parquet/arrow,
    a folder, a hub id) or {path, name, split, columns, streaming} (dataset_rows.DatasetSpec), also accepted as
    dataset_path; unset generates problems instead."""
    max_turns: Annotated[int, Field(ge=1)] = 4
    """Model turns per rollout: calculator calls, then the answer (a turn without tool calls ends the rollout)."""
    correct_answer_weight: float = 1.0
    """Weight of the correct_answer reward (1 if the final answer equals the target)."""
    tool_use_weight: float = 0.1
    """Weight of the tool_use reward (1 if the calculator was called at least once with a valid expression)."""


class Gsm8kCalcData(vf.TaskData):
    answer: str
    """The target final answer, a plain number."""
    source: str
    """The generator template that made the problem, or 'gsm8k' for a row of the dataset."""
    tools: list[str] = [CALCULATOR]
    """Tools offered to the model, as module:function import paths."""
    final_tools: list[str] = []
    """Names of tools whose call ends the rollout."""
    max_turns: int = 4
    """Model turns per rollout."""


class Gsm8kCalcTask(vf.Task[Gsm8kCalcData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, task: Gsm8kCalcData, trace: vf.Trace) -> float:
        return float(is_correct(trace.last_reply, task.answer))

    @vf.reward(weight=0.1)
    async def tool_use(self, trace: vf.Trace) -> float:
        return tool_use_score(calculator_expressions(trace.assistant_messages))

    @vf.metric
    async def calculator_calls(self, trace: vf.Trace) -> float:
        return float(len(calculator_expressions(trace.assistant_messages)))


class Gsm8kCalcTaskset(vf.Taskset[Gsm8kCalcTask, Gsm8kCalcConfig]):
    def __init__(self, config: Gsm8kCalcConfig) -> None:
        super().__init__(config)
        # Read the dataset now, so a bad one fails when the environment loads, not mid-run.
        self.problems = self._problems()
        # The reward weights of the config, unless the run plugs its own under task.rewards.
        weights = {"correct_answer": config.correct_answer_weight, "tool_use": config.tool_use_weight}
        self.task_config = with_reward_weights(config.task, weights)

    def _problems(self) -> list[Problem]:
        if self.config.dataset is not None:
            return load_gsm8k(self.config.dataset, self.config.num_examples)
        return generate_problems(self.config.num_examples or DEFAULT_NUM_EXAMPLES, self.config.seed)

    def load(self):
        for i, problem in enumerate(self.problems):
            data = Gsm8kCalcData(
                id=f"gsm8k-calc-{i}",
                prompt=problem.question,
                system_prompt=SYSTEM_PROMPT,
                answer=problem.answer,
                source=problem.source,
                max_turns=self.config.max_turns,
            )
            yield Gsm8kCalcTask(data, self.task_config)


__all__ = [
    "InProcessHarness",
    "Gsm8kCalcTaskset",
    "calculator",
    "calculator_expressions",
    "generate_problems",
    "load_gsm8k",
    "parse_final_answer",
    "tool_use_score",
]
