"""An in-process verifiers harness: the chat loop runs in the orchestrator, tools are Python callables.

verifiers' stock harnesses start a Python subprocess per rollout (about 1 rollout/s on two cores); this one
runs tens per second. Every model call still goes through the endpoint verifiers hands to ``launch``, so
verifiers' training client records the exact token ids, sampled mask and logprobs of each turn.
"""

import importlib
import inspect
import json
import sys
import typing

import httpx
import openai
import verifiers.v1 as vf
from openai import AsyncOpenAI

# verifiers finds a harness by id, importing the module named like the id: register this one under it.
HARNESS_ID = "trident-in-process"
sys.modules.setdefault(HARNESS_ID.replace("-", "_"), sys.modules[__name__])

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _import(path: str) -> typing.Callable:
    module, _, name = path.rpartition(":")
    return getattr(importlib.import_module(module), name)


def tool_spec(fn: typing.Callable) -> dict:
    """The OpenAI function-tool declaration of a plain Python callable (its signature and docstring)."""
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": inspect.getdoc(fn) or "",
            "parameters": {
                "type": "object",
                "properties": {name: {"type": _JSON_TYPES.get(hints.get(name), "string")} for name in params},
                "required": [n for n, p in params.items() if p.default is inspect.Parameter.empty],
            },
        },
    }


class InProcessHarnessConfig(vf.HarnessConfig):
    tools: list[str] = []
    """Tools as `module:function` import paths."""
    max_turns: int = 1
    """Model turns per rollout; a turn without tool calls ends the rollout."""
    request_timeout_s: float = 600.0
    """Seconds one model call may take (connecting gets 60 s: a busy 2-core machine accepts slowly)."""


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
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
        tools = {fn.__name__: fn for fn in map(_import, self.config.tools)}
        extra = {"tools": [tool_spec(fn) for fn in tools.values()]} if tools else {}
        client = AsyncOpenAI(
            base_url=endpoint,
            api_key=secret,
            max_retries=0,
            timeout=httpx.Timeout(self.config.request_timeout_s, connect=60.0),
        )
        try:
            for _ in range(self.config.max_turns):
                response = await client.chat.completions.create(model=ctx.model, messages=messages, **extra)
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": await _call_tool(tools, call)})
        except openai.APIError as e:  # e.g. the context is full: verifiers records the stop condition
            return vf.ProgramResult(exit_code=1, stdout="", stderr=str(e))
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _call_tool(tools: dict[str, typing.Callable], call) -> str:
    """Run one tool call; errors go back to the model as the tool's answer."""
    try:
        result = tools[call.function.name](**json.loads(call.function.arguments or "{}"))
        if inspect.isawaitable(result):
            result = await result
        return str(result)
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


__all__ = ["InProcessHarness"]
