"""recursive-reasoner: a planner (the policy, typically a LoRA adapter) decomposes math word problems for a frozen
worker (the base model on the same server).

The planner reads a problem and answers with one JSON object (:mod:`recursive_reasoner.plan`):
``{"should_decompose": bool, "subproblems": [str, ...], "plan": str}``. That single turn is the rollout's only
trained model call. After it, :meth:`RecursiveReasonerTask.finalize` has the worker (``worker_model`` at
``worker_base_url``, :mod:`recursive_reasoner.worker`) solve each subproblem and combine their solutions, or solve
the problem directly when the planner does not decompose, and records the :class:`~recursive_reasoner.outcome.Outcome`
on the trace (``trace.info["recursive_reasoner"]``: the plan, each worker call with the model it named and the model
the server answered with, the final answer) and, with ``log_path``, as a JSON line in that file.

Reward: ``correctness_weight × correct + token_weight × token_efficiency + independence_weight × independence``
(defaults 1.0, 0.2, 0.3), where ``token_efficiency = max(0, 1 - tokens / token_budget)`` counts the completion
tokens of the planner and of every worker call, and ``independence`` is the mean pairwise dissimilarity of the
subproblems (:mod:`recursive_reasoner.independence`: lexical by default, sentence embeddings with
``embedding_model_path``). A malformed plan gets 0 on every term. Metrics: ``malformed``, ``decomposed``,
``subproblems`` and ``tokens``.

Problems come from gsm8k-calc: its seeded generator, or a GSM8K-format dataset (``dataset``, e.g. a local JSONL file).
"""

import json
from typing import Annotated

import verifiers.v1 as vf
from dataset_rows import TasksetDataset
from gsm8k_calc.problems import Problem, generate_problems, load_gsm8k
from pydantic import Field
from reward_weights import with_reward_weights

from orchestrator.verifiers_adapter.harness import InProcessHarness
from recursive_reasoner.independence import independence_measure
from recursive_reasoner.outcome import Outcome, evaluate
from recursive_reasoner.worker import WorkerSettings, server_worker

DEFAULT_NUM_EXAMPLES = 1024
INFO_KEY = "recursive_reasoner"
"""Where the outcome is recorded in ``trace.info``."""
SYSTEM_PROMPT = (
    "You plan how a worker model solves a math word problem; do not solve it yourself. Reply with one JSON object and "
    'nothing else: {{"should_decompose": true or false, "subproblems": [...], "plan": "..."}}. To decompose, list 2 '
    "to {max_subproblems} subproblems that can each be solved on its own, as different from each other as possible: "
    "the worker solves each one, then combines their answers as your plan says. Otherwise set should_decompose to "
    "false and subproblems to [], and the worker solves the problem directly, following your plan. Be brief: every "
    "token counts."
)


class RecursiveReasonerConfig(vf.TasksetConfig):
    num_examples: Annotated[int | None, Field(ge=1)] = None
    """Problems generated (1024 when unset); with dataset, its first num_examples rows (all when unset)."""
    seed: int = 0
    """Seed of the problem generator (unused with dataset)."""
    dataset: TasksetDataset = None
    """GSM8K-format rows ('question', and an 'answer' ending in '#### <number>'): a path (local JSONL/parquet/arrow,
    a folder, a hub id) or {path, name, split, columns, streaming} (dataset_rows.DatasetSpec), also accepted as
    dataset_path; unset generates problems instead."""
    worker_model: str
    """Model name the worker's requests send: the base model's name (``[model] name``), which the server keeps
    serving next to the trained adapter."""
    worker_base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible API root of the server the worker calls."""
    worker_max_tokens: Annotated[int, Field(ge=1)] = 256
    """Tokens per worker reply."""
    worker_temperature: Annotated[float, Field(ge=0)] = 0.0
    """Sampling temperature of the worker (0: greedy, the same plan gets the same answer)."""
    worker_enable_thinking: bool = False
    """Let the worker think (Qwen3 <think>) before answering."""
    max_subproblems: Annotated[int, Field(ge=2)] = 4
    """Most subproblems a plan may list (more is malformed)."""
    token_budget: Annotated[int, Field(ge=1)] = 2048
    """Completion tokens (planner + worker) at which token efficiency reaches 0."""
    embedding_model_path: str | None = None
    """Local sentence-transformers model folder: independence from embeddings (needs sentence-transformers installed);
    unset: the lexical measure."""
    log_path: str | None = None
    """File to append one JSON line per rollout to: the plan (or why it is malformed), the worker's calls (the model
    each one named and the one the server answered as), the final answer."""
    correctness_weight: float = 1.0
    """Weight of correct (1 if the final answer equals the target)."""
    token_weight: float = 0.2
    """Weight of token_efficiency."""
    independence_weight: float = 0.3
    """Weight of independence."""


class RecursiveReasonerData(vf.TaskData):
    answer: str
    """The target final answer, a plain number."""
    source: str
    """The generator template that made the problem, or 'gsm8k' for a row of the dataset."""
    worker: WorkerSettings
    max_subproblems: int = 4
    token_budget: int = 2048
    embedding_model_path: str | None = None
    log_path: str | None = None


def outcome_of(trace: vf.Trace) -> Outcome:
    """The outcome :meth:`RecursiveReasonerTask.finalize` recorded on the trace."""
    if INFO_KEY not in trace.info:
        raise RuntimeError(f"trace.info has no {INFO_KEY!r}: score a trace after RecursiveReasonerTask.finalize")
    return Outcome.model_validate(trace.info[INFO_KEY])


def record(trace: vf.Trace, data: RecursiveReasonerData, outcome: Outcome) -> None:
    """Put the outcome on the trace (the worker's usage apart from the planner's) and in the log file."""
    recorded = outcome.model_dump(mode="json")
    trace.info[INFO_KEY] = recorded
    for call in outcome.calls:
        trace.extra_usage.append(vf.Usage(prompt_tokens=call.prompt_tokens, completion_tokens=call.completion_tokens))
    if data.log_path:
        line = {"task": data.id, "rollout": trace.id, **recorded}
        with open(data.log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")


class RecursiveReasonerTask(vf.Task[RecursiveReasonerData, vf.State, vf.TaskConfig]):
    async def finalize(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        """Carry out the planner's reply with the worker; record the outcome."""
        data = self.data
        usage = trace.usage
        async with server_worker(data.worker) as worker:
            outcome = await evaluate(
                data.prompt_text,
                data.answer,
                trace.last_reply,
                worker,
                independence_measure(data.embedding_model_path),
                data.max_subproblems,
                planner_tokens=usage.completion_tokens if usage else 0,
                planner_model=trace.calls[-1].model if trace.calls else None,
            )
        record(trace, data, outcome)

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(outcome_of(trace).correct)

    @vf.reward(weight=0.2)
    async def token_efficiency(self, task: RecursiveReasonerData, trace: vf.Trace) -> float:
        return outcome_of(trace).token_efficiency(task.token_budget)

    @vf.reward(weight=0.3)
    async def independence(self, trace: vf.Trace) -> float:
        return outcome_of(trace).independence

    @vf.metric
    async def malformed(self, trace: vf.Trace) -> float:
        return float(outcome_of(trace).malformed is not None)

    @vf.metric
    async def decomposed(self, trace: vf.Trace) -> float:
        return float(outcome_of(trace).decomposed)

    @vf.metric
    async def subproblems(self, trace: vf.Trace) -> float:
        plan = outcome_of(trace).plan
        return float(len(plan.subproblems)) if plan else 0.0

    @vf.metric
    async def tokens(self, trace: vf.Trace) -> float:
        return float(outcome_of(trace).tokens)


class RecursiveReasonerTaskset(vf.Taskset[RecursiveReasonerTask, RecursiveReasonerConfig]):
    def __init__(self, config: RecursiveReasonerConfig) -> None:
        super().__init__(config)
        # Read the file and load the embedding model now, so a bad path fails when the environment loads.
        self.problems = self._problems()
        independence_measure(config.embedding_model_path)

    def _problems(self) -> list[Problem]:
        if self.config.dataset is not None:
            return load_gsm8k(self.config.dataset, self.config.num_examples)
        return generate_problems(self.config.num_examples or DEFAULT_NUM_EXAMPLES, self.config.seed)

    def load(self):
        config = self.config
        task_config = self.task_config()
        worker = WorkerSettings(
            base_url=config.worker_base_url,
            model=config.worker_model,
            max_tokens=config.worker_max_tokens,
            temperature=config.worker_temperature,
            enable_thinking=config.worker_enable_thinking,
        )
        system_prompt = SYSTEM_PROMPT.format(max_subproblems=config.max_subproblems)
        for i, problem in enumerate(self.problems):
            data = RecursiveReasonerData(
                id=f"recursive-reasoner-{i}",
                prompt=problem.question,
                system_prompt=system_prompt,
                answer=problem.answer,
                source=problem.source,
                worker=worker,
                max_subproblems=config.max_subproblems,
                token_budget=config.token_budget,
                embedding_model_path=config.embedding_model_path,
                log_path=config.log_path,
            )
            yield RecursiveReasonerTask(data, task_config)

    def task_config(self) -> vf.TaskConfig:
        """The config's task settings, with this config's reward weights (a weight set under ``task.rewards``
        wins)."""
        config = self.config
        weights = {
            "correct": config.correctness_weight,
            "token_efficiency": config.token_weight,
            "independence": config.independence_weight,
        }
        return with_reward_weights(config.task, weights)


__all__ = [
    "InProcessHarness",
    "RecursiveReasonerConfig",
    "RecursiveReasonerData",
    "RecursiveReasonerTask",
    "RecursiveReasonerTaskset",
]
