"""What a rollout came to, and the reward terms read from it.

:func:`evaluate` parses the planner's reply, has the worker carry the plan out and checks the final answer. The
:class:`Outcome` it returns holds everything the rewards need, plus the worker's calls (which model each one
named, and which the server answered with):

- ``correct``: the last worker reply's final answer equals the target (``#### <n>``, ``\\boxed{n}`` or the last
  number, read as gsm8k-calc reads answers);
- ``tokens``: completion tokens of the rollout, the planner's plus every worker call's (prompts not counted);
  token efficiency is ``max(0, 1 - tokens / token_budget)``;
- ``independence``: of the subproblems (:mod:`recursive_reasoner.independence`), 0 without decomposition.

A malformed plan makes no worker call, and every reward term is 0.
"""

import asyncio
from decimal import Decimal

from gsm8k_calc.answers import canonical_number, parse_final_answer, parse_number
from pydantic import BaseModel, computed_field

from recursive_reasoner.independence import Measure
from recursive_reasoner.plan import MalformedPlan, Plan, parse_plan, strip_thinking
from recursive_reasoner.worker import Worker, WorkerCall, solve


class Outcome(BaseModel):
    planner_model: str | None = None
    """The model name the planner's call sent (the current adapter's under LoRA)."""
    planner_tokens: int = 0
    malformed: str | None = None
    """Why the planner's reply is not a valid plan; None when it is one."""
    plan: Plan | None = None
    calls: list[WorkerCall] = []
    final_answer: str | None = None
    """The number read from the last worker reply."""
    correct: bool = False
    independence: float = 0.0

    @computed_field
    @property
    def decomposed(self) -> bool:
        return self.plan is not None and self.plan.should_decompose

    @computed_field
    @property
    def tokens(self) -> int:
        """Completion tokens of the planner and of every worker call."""
        return self.planner_tokens + sum(call.completion_tokens for call in self.calls)

    def token_efficiency(self, token_budget: int) -> float:
        """``max(0, 1 - tokens / token_budget)``; 0 for a malformed plan."""
        return 0.0 if self.malformed is not None else max(0.0, 1.0 - self.tokens / token_budget)


def final_answer(reply: str) -> Decimal | None:
    """The final answer of a worker reply, its thinking left out."""
    return parse_final_answer(strip_thinking(reply))


async def evaluate(
    question: str,
    target: str,
    reply: str,
    worker: Worker,
    measure: Measure,
    max_subproblems: int,
    planner_tokens: int = 0,
    planner_model: str | None = None,
) -> Outcome:
    """The outcome of the planner's ``reply`` to ``question`` (whose answer is ``target``), carried out by
    ``worker``; ``measure`` gives the subproblems' independence."""
    planner = {"planner_tokens": planner_tokens, "planner_model": planner_model}
    try:
        plan = parse_plan(reply, max_subproblems)
    except MalformedPlan as e:
        return Outcome(**planner, malformed=str(e))
    calls = await solve(question, plan, worker)
    answer = final_answer(calls[-1].reply)
    return Outcome(
        **planner,
        plan=plan,
        calls=calls,
        final_answer=None if answer is None else canonical_number(answer),
        correct=answer is not None and answer == parse_number(target),
        independence=await asyncio.to_thread(measure, plan.subproblems) if plan.should_decompose else 0.0,
    )


__all__ = ["Outcome", "evaluate", "final_answer"]
