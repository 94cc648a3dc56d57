"""The frozen worker: solves what the planner asks, through the inference server's OpenAI-compatible chat route.

:func:`solve` carries out a plan. Without decomposition the worker solves the problem directly (one ``direct``
call, given the plan). With decomposition it solves each subproblem (one ``subproblem`` call each, concurrently,
each given the whole problem for context), then one ``combine`` call gets the problem, the plan and the parts'
solutions and gives the final answer. Every call asks for a last line ``#### <answer>``.

:class:`ServerWorker` makes the calls with ``POST {base_url}/chat/completions`` and ``model = <worker model>`` (under
LoRA training: the base model, which the server keeps serving under its own name next to the adapter). They go
around verifiers' training client, so none of their tokens is ever trained. Tests pass any :data:`Worker`.
"""

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict

from recursive_reasoner.plan import Plan, strip_thinking

Stage = Literal["direct", "subproblem", "combine"]
Messages = list[dict[str, str]]
TIMEOUT_S = 300.0
API_KEY_ENV = "TRIDENT_API_KEY"
"""The inference server's key, sent when set (the server checks it when it was started with one)."""
SYSTEM_PROMPT = (
    "You are a careful math solver. Solve what you are asked step by step, then end your reply with a last line of "
    "the form '#### 42', giving the answer as a number only."
)


class WorkerSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    base_url: str
    """OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1."""
    model: str
    """The model name the worker's requests send."""
    max_tokens: int
    temperature: float
    enable_thinking: bool


class WorkerCall(BaseModel):
    """One worker call, as recorded on the rollout."""

    stage: Stage
    model: str
    """The model name the request sent."""
    served_model: str
    """The model name the server answered with."""
    reply: str
    prompt_tokens: int
    completion_tokens: int


Worker = Callable[[Stage, Messages], Awaitable[WorkerCall]]
"""Answers one chat (system + user message) at a stage of :func:`solve`."""


class WorkerError(RuntimeError):
    """The server refused or failed a worker call."""


class ServerWorker:
    """A :data:`Worker` on the server at ``settings.base_url``, serving ``settings.model``."""

    def __init__(self, settings: WorkerSettings, client: httpx.AsyncClient) -> None:
        self.settings, self.client = settings, client

    async def __call__(self, stage: Stage, messages: Messages) -> WorkerCall:
        settings = self.settings
        url = f"{settings.base_url.rstrip('/')}/chat/completions"
        response = await self.client.post(
            url,
            headers={"Authorization": f"Bearer {key}"} if (key := os.environ.get(API_KEY_ENV)) else {},
            json={
                "model": settings.model,
                "messages": messages,
                "max_tokens": settings.max_tokens,
                "temperature": settings.temperature,
                "chat_template_kwargs": {"enable_thinking": settings.enable_thinking},
            },
        )
        if response.status_code != 200:
            raise WorkerError(
                f"worker model {settings.model!r} at {url} answered {response.status_code}: {response.text[:200]}"
            )
        body = response.json()
        usage = body.get("usage") or {}
        return WorkerCall(
            stage=stage,
            model=settings.model,
            served_model=str(body.get("model", "")),
            reply=body["choices"][0]["message"].get("content") or "",
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
        )


@asynccontextmanager
async def server_worker(settings: WorkerSettings) -> AsyncIterator[Worker]:
    """A :class:`ServerWorker` with its own HTTP client, closed on exit."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        yield ServerWorker(settings, client)


def chat(user: str) -> Messages:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def direct_messages(question: str, plan: str) -> Messages:
    return chat(f"Problem: {question}" + (f"\n\nPlan: {plan}" if plan else ""))


def subproblem_messages(question: str, subproblem: str) -> Messages:
    return chat(f"This is part of a larger problem:\n{question}\n\nSolve only this part:\n{subproblem}")


def combine_messages(question: str, plan: Plan, solutions: list[str]) -> Messages:
    parts = "\n\n".join(
        f"Part {i}: {subproblem}\nSolution: {solution}"
        for i, (subproblem, solution) in enumerate(zip(plan.subproblems, solutions, strict=True), start=1)
    )
    return chat(
        f"Problem: {question}\n\n"
        + (f"Plan: {plan.plan}\n\n" if plan.plan else "")
        + f"Its parts, already solved:\n\n{parts}\n\nUse these to answer the problem."
    )


async def solve(question: str, plan: Plan, worker: Worker) -> list[WorkerCall]:
    """The worker's calls carrying out ``plan`` on ``question``, in order; the last one's reply holds the answer."""
    if not plan.should_decompose:
        return [await worker("direct", direct_messages(question, plan.plan))]
    parts = await asyncio.gather(*(worker("subproblem", subproblem_messages(question, s)) for s in plan.subproblems))
    combined = await worker("combine", combine_messages(question, plan, [strip_thinking(p.reply) for p in parts]))
    return [*parts, combined]


__all__ = [
    "SYSTEM_PROMPT",
    "ServerWorker",
    "Stage",
    "Worker",
    "WorkerCall",
    "WorkerError",
    "WorkerSettings",
    "server_worker",
    "solve",
]
