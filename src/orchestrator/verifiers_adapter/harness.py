"""An in-process verifiers harness: the chat loop runs in the orchestrator; tools are Python callables and the
task's MCP tool servers.

verifiers' stock harnesses start a Python subprocess per rollout (about 1 rollout/s on two cores); this one
runs tens per second. Every model call still goes through the endpoint verifiers hands to ``launch``, so
verifiers' training client records the exact token ids, sampled mask and logprobs of each turn.

Tools come from two places, offered to the model together:

- the ``vf.Toolset`` servers verifiers starts for the rollout (``Task.toolsets``, one per rollout;
  ``Taskset.toolsets``, shared) or reaches by URL: their tools, listed and called over MCP, named
  ``<server>_<tool>`` as verifiers' own chat program names them;
- Python callables named on the task (below).

An environment may describe its agent loop on each task's ``TaskData`` with these optional fields:

- ``tools: list[str]``: tools as ``module:function`` import paths. A tool's name, description and JSON
  parameters come from the function's name, docstring and type hints. Parameters named ``runtime`` (the
  rollout's verifiers runtime; ``runtime.workdir`` is a fresh directory per rollout) and ``task`` (the
  TaskData) are filled in by the harness and hidden from the model. A tool returns text, or a list of verifiers'
  content parts (``vf.TextContentPart``, ``vf.ImageUrlContentPart``: e.g. an image) that its tool message carries
  as they are. A plain (not ``async``) function runs in a
  worker thread of the event loop's default executor, so it may block; several may run at once.
- ``final_tools: list[str]``: names of tools whose call ends the rollout.
- ``max_turns: int``: model turns per rollout (default: no limit but the agent's ``max_turns`` in verifiers;
  a reply without a tool call ends the rollout).
- ``user: str``: a simulated user as a ``module:function`` path, called as ``fn(messages, task)`` whenever the
  model answers without a tool call; what it returns (text, or content parts as from a tool) is the next user
  message, ``None`` ends the rollout.
"""

import asyncio
import importlib
import inspect
import itertools
import json
import typing
from contextlib import AsyncExitStack

import aiohttp
import verifiers.v1 as vf
from pydantic_core import from_json, to_json
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

# verifiers finds a harness by id, importing the module named like the id (registered by install_patches)
HARNESS_ID = "trident-in-process"

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
INJECTED = ("runtime", "task")  # tool parameters the harness fills in
JSON_CONTENT = {"Content-Type": "application/json"}


def _without_none(value):
    """``value`` with the ``None`` entries of its dicts dropped, at every depth."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


class ModelCallError(Exception):
    """The endpoint refused a model call or could not be reached (e.g. the context is full)."""


async def chat_completion(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One OpenAI chat-completions call to verifiers' endpoint; the reply's message, its ``None`` fields left out.

    Plain JSON over aiohttp: the OpenAI SDK's request and reply models, and httpx's connection pool (which checks
    every open connection at each request's end), cost more CPU than the rest of the harness. pydantic-core writes
    and reads the JSON (the whole conversation, every turn) several times faster than the ``json`` module.
    """
    try:
        async with http.post(url, data=to_json(body), headers=JSON_CONTENT) as response:
            if response.status != 200:
                raise ModelCallError(f"Error code: {response.status} - {await response.text()}")
            reply = from_json(await response.read())
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ModelCallError(f"{type(e).__name__}: {e}") from e
    return _without_none(reply["choices"][0]["message"])


def _import(path: str) -> typing.Callable:
    module, _, name = path.rpartition(":")
    return getattr(importlib.import_module(module), name)


def _json_type(hint) -> dict:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (str,)
        return {"type": "array", "items": {"type": _JSON_TYPES.get(item, "string")}}
    return {"type": _JSON_TYPES.get(hint, "string")}


def tool_spec(fn: typing.Callable) -> dict:
    """The OpenAI function-tool declaration of a plain Python callable (its signature and docstring)."""
    hints = typing.get_type_hints(fn)
    params = {n: p for n, p in inspect.signature(fn).parameters.items() if n not in INJECTED}
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": inspect.getdoc(fn) or "",
            "parameters": {
                "type": "object",
                "properties": {name: _json_type(hints.get(name)) for name in params},
                "required": [n for n, p in params.items() if p.default is inspect.Parameter.empty],
            },
        },
    }


Content = str | list[dict]
"""A message's content: text, or OpenAI content parts (``{"type": "image_url", ...}``)."""
CONTENT_PARTS = (vf.TextContentPart, vf.ImageUrlContentPart)


def message_content(value) -> Content:
    """What a tool or the simulated user returned, as a message's content: a list of verifiers' content parts as
    OpenAI content-part dicts, anything else as its text."""
    if isinstance(value, list) and value and all(isinstance(part, CONTENT_PARTS) for part in value):
        return [part.model_dump() for part in value]
    return str(value)


async def _answer(arguments: str, run: typing.Callable[[dict], typing.Awaitable[Content]]) -> Content:
    """``run`` on a tool call's JSON arguments; errors, bad arguments included, go back to the model as the tool's
    answer."""
    try:
        kwargs = json.loads(arguments or "{}")
        if not isinstance(kwargs, dict):
            raise TypeError(f"arguments must be a JSON object, got {arguments!r}")
        return await run(kwargs)
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


async def call_tool(fn: typing.Callable, arguments: str, injected: dict[str, typing.Any]) -> Content:
    """Run one call of a Python tool, the harness's parameters (:data:`INJECTED`) filled in. A plain function runs
    in a worker thread, so a tool that blocks (files, subprocesses, a slow computation) holds up no other rollout."""

    async def run(kwargs: dict) -> Content:
        wanted = inspect.signature(fn).parameters
        kwargs = {k: v for k, v in kwargs.items() if k not in INJECTED}
        kwargs.update({k: v for k, v in injected.items() if k in wanted})
        if inspect.iscoroutinefunction(fn):
            return message_content(await fn(**kwargs))
        return message_content(await _maybe_await(await asyncio.to_thread(fn, **kwargs)))

    return await _answer(arguments, run)


async def call_mcp_tool(servers, dispatch, name: str, arguments: str) -> Content:
    """Run one call of an MCP tool through verifiers' client (which reconnects and retries): text, or content parts
    where the tool's result holds an image."""

    async def run(kwargs: dict) -> Content:
        return await call_mcp(servers, dispatch, name, kwargs)

    return await _answer(arguments, run)


def _root_cause(error: BaseException) -> str:
    """The first leaf of an exception group (anyio wraps the MCP client's errors), as ``Type: message``."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class InProcessHarnessConfig(vf.HarnessConfig):
    request_timeout_s: float = 600.0
    """Seconds one model call may take (connecting gets 60 s: a busy 2-core machine accepts slowly)."""
    mcp_connect_timeout_s: float = 60.0
    """Seconds to connect to the rollout's MCP tool servers and list their tools."""


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        tools = {fn.__name__: fn for fn in map(_import, getattr(data, "tools", None) or [])}
        final_tools = set(getattr(data, "final_tools", None) or [])
        user = getattr(data, "user", None)
        user = _import(user) if user else None
        max_turns = getattr(data, "max_turns", None)
        injected = {"runtime": runtime, "task": data}
        url = endpoint.rstrip("/") + "/chat/completions"
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, connect=60.0)
        async with AsyncExitStack() as stack:
            headers = {"Authorization": f"Bearer {secret}"}
            http = await stack.enter_async_context(aiohttp.ClientSession(headers=headers, timeout=timeout))
            mcp_specs, dispatch, servers = [], {}, {}
            if mcp_urls:
                spec = {"mcpServers": {name: {"url": url, "connect_timeout": self.config.mcp_connect_timeout_s}
                                       for name, url in mcp_urls.items()}}  # fmt: skip
                try:
                    mcp_specs, dispatch, servers = await connect_mcp(spec, stack, reserved=set(tools))
                except Exception as e:  # verifiers' type for a tool server that cannot be reached: infrastructure
                    raise vf.ToolsetError(f"cannot list the tools of MCP servers {mcp_urls}: {_root_cause(e)}") from e
            specs = [tool_spec(fn) for fn in tools.values()] + mcp_specs
            extra = {"tools": specs} if specs else {}
            try:
                for _ in range(max_turns) if max_turns is not None else itertools.count():
                    body = {"model": ctx.model, "messages": messages, **extra}
                    message = await chat_completion(http, url, body)
                    messages.append(message)
                    calls = message.get("tool_calls") or []
                    if calls and specs:  # with no tool offered, a parsed call is just a reply
                        for call in calls:
                            name, arguments = call["function"]["name"], call["function"].get("arguments", "")
                            if name in tools:
                                content = await call_tool(tools[name], arguments, injected)
                            elif name in dispatch:
                                content = await call_mcp_tool(servers, dispatch, name, arguments)
                            else:
                                known = sorted([*tools, *dispatch])
                                content = f"error: no tool named {name!r}; tools: {known}"
                            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
                        if final_tools & {call["function"]["name"] for call in calls}:
                            break
                        continue
                    reply = await _maybe_await(user(messages, data)) if user else None
                    if reply is None:
                        break
                    messages.append({"role": "user", "content": message_content(reply)})
            except ModelCallError as e:  # e.g. the context is full: verifiers records the stop condition
                return vf.ProgramResult(exit_code=1, stdout="", stderr=str(e))
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["InProcessHarness"]
