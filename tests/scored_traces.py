"""A task scored through verifiers' own scoring, for a rollout made by hand: the tests of environments' rewards."""

import asyncio

import verifiers.v1 as vf
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask


def scored_trace(task: vf.Task, replies: list[vf.AssistantMessage]) -> vf.Trace:
    """The trace of a rollout of ``task`` (its prompt: a string or messages) in which the model sent ``replies``,
    one message after another, with ``task``'s rewards and metrics recorded."""
    prompt = task.data.prompt
    messages = [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt)
    nodes = [MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(messages)]
    nodes += [MessageNode(parent=len(messages) + i - 1, sampled=True, message=m) for i, m in enumerate(replies)]
    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data),
        agent=AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())),
        nodes=nodes,
    )
    asyncio.run(task.score(trace))
    return trace
