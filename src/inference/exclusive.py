"""On a server with LoRA, a request for prompt logprobs (the orchestrator's probe after each reload) runs alone.

vLLM 0.32 maps LoRA over the rows a batch samples from, one per request; the prompt rows of a request asking for
prompt logprobs get that mapping too, so batched with other requests they get the wrong adapter, or none that fits:
on CPU the engine dies ("einsum(): subscript b has size 33 for operand 1 which does not broadcast with previously
seen size 34"). Alone in its batch, the one mapping fits every row. The orchestrator starts a step's groups while
the previous step's rollouts run, so a probe always has company unless the server holds it apart.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.inference_api import GENERATION_ROUTES


class ExclusiveGate:
    """Shared holders run together; an exclusive holder waits for those inside, and holds back new ones (shared or
    exclusive) until it is done."""

    def __init__(self):
        self.changed = asyncio.Condition()
        self.inside = 0  # shared holders inside
        self.exclusive_held = False  # an exclusive holder is inside or waiting for the shared ones to leave

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self.changed:
            await self.changed.wait_for(lambda: not self.exclusive_held)
            self.inside += 1
        try:
            yield
        finally:
            async with self.changed:
                self.inside -= 1
                self.changed.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self.changed:
            await self.changed.wait_for(lambda: not self.exclusive_held)
            self.exclusive_held = True
            try:
                await self.changed.wait_for(lambda: self.inside == 0)
            except BaseException:
                self.exclusive_held = False
                self.changed.notify_all()
                raise
        try:
            yield
        finally:
            async with self.changed:
                self.exclusive_held = False
                self.changed.notify_all()


def asks_prompt_logprobs(body: bytes) -> bool:
    """Whether a generation request's JSON body asks for prompt logprobs (``prompt_logprobs``, top level or in
    ``sampling_params``, or ``echo`` with ``logprobs``)."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    params = data.get("sampling_params")
    nested = params.get("prompt_logprobs") if isinstance(params, dict) else None
    echoed = bool(data.get("echo")) and data.get("logprobs") is not None
    return data.get("prompt_logprobs") is not None or nested is not None or echoed


async def read_body(receive: Receive) -> tuple[bytes, Receive]:
    """A request's whole body, and a ``receive`` for the app behind that gives the body read, then whatever comes
    next (a disconnect)."""
    messages = [await receive()]
    while messages[-1]["type"] == "http.request" and messages[-1].get("more_body", False):
        messages.append(await receive())
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return body, replay


class PromptLogprobsAlone:
    """ASGI middleware: generation requests pass an :class:`ExclusiveGate`, exclusively when they ask for prompt
    logprobs; each holds it until its whole reply (a stream's last chunk too) is sent."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.gate = ExclusiveGate()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_ROUTES:
            await self.app(scope, receive, send)
            return
        body, replay = await read_body(receive)
        hold = self.gate.exclusive() if asks_prompt_logprobs(body) else self.gate.shared()
        async with hold:
            await self.app(scope, replay, send)
