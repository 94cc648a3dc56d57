import asyncio
import json
import threading
from types import SimpleNamespace

import aiohttp
import pytest
import verifiers.v1 as vf
from aiohttp import web
from aiohttp.test_utils import TestServer

from orchestrator.verifiers_adapter.harness import (
    ModelCallError,
    call_mcp_tool,
    call_tool,
    chat_completion,
    message_content,
    tool_spec,
)


def calculator(expression: str, precision: int = 2) -> str:
    """Evaluate an arithmetic expression."""
    return expression


def test_tool_spec_from_signature_and_docstring():
    spec = tool_spec(calculator)["function"]
    assert spec["name"] == "calculator"
    assert spec["description"] == "Evaluate an arithmetic expression."
    assert spec["parameters"]["properties"] == {"expression": {"type": "string"}, "precision": {"type": "integer"}}
    assert spec["parameters"]["required"] == ["expression"]


def read_file(path: str, files: list[str], runtime, task) -> str:
    """Read a file of the rollout's copy."""
    return f"{runtime}:{task}:{path}:{','.join(files)}"


def test_tool_spec_hides_injected_parameters_and_types_lists():
    params = tool_spec(read_file)["function"]["parameters"]
    assert params["properties"] == {"path": {"type": "string"}, "files": {"type": "array", "items": {"type": "string"}}}
    assert params["required"] == ["path", "files"]


def test_call_tool_injects_runtime_and_task_and_ignores_model_supplied_ones():
    args = json.dumps({"path": "a.py", "files": ["x", "y"], "runtime": "evil"})
    result = asyncio.run(call_tool(read_file, args, {"runtime": "R", "task": "T"}))
    assert result == "R:T:a.py:x,y"


def test_call_tool_reports_errors_to_the_model():
    assert asyncio.run(call_tool(read_file, "not json", {})).startswith("error: JSONDecodeError")
    assert asyncio.run(call_tool(read_file, "[1]", {})).startswith("error: TypeError: arguments must be")
    assert asyncio.run(call_tool(read_file, "{}", {"runtime": 1, "task": 2})).startswith("error: TypeError")


async def _against(handler, call):
    """``call(session, url)`` against a real aiohttp server answering ``POST /chat/completions`` with ``handler``."""
    app = web.Application()
    app.router.add_post("/chat/completions", handler)
    async with TestServer(app) as server, aiohttp.ClientSession(headers={"Authorization": "Bearer s3"}) as http:
        return await call(http, str(server.make_url("/chat/completions")))


def test_chat_completion_sends_the_body_and_returns_the_message_without_none_fields():
    seen = {}

    async def handler(request):
        seen.update(body=await request.json(), auth=request.headers["Authorization"])
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": None}
        message = {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None}
        return web.json_response({"choices": [{"index": 0, "message": message}]})

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    message = asyncio.run(_against(handler, lambda http, url: chat_completion(http, url, body)))
    assert seen == {"body": body, "auth": "Bearer s3"}
    assert message == {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                            "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip


def test_chat_completion_raises_the_endpoints_refusal_and_an_unreachable_endpoint():
    async def refuse(request):
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    with pytest.raises(ModelCallError, match="Error code: 400 - .*prompt too long"):
        asyncio.run(_against(refuse, lambda http, url: chat_completion(http, url, {})))

    async def unreachable():
        async with aiohttp.ClientSession() as http:
            return await chat_completion(http, "http://127.0.0.1:9/chat/completions", {})

    with pytest.raises(ModelCallError, match="ClientConnectorError"):
        asyncio.run(unreachable())


def test_a_blocking_tool_runs_off_the_event_loop():
    released = threading.Event()

    def wait_for_the_loop() -> str:
        """Block until the event loop runs again."""
        return "ran beside the loop" if released.wait(timeout=30) else "blocked the loop"

    async def call():
        asyncio.get_running_loop().call_soon(released.set)  # runs only if the tool leaves the loop free
        return await call_tool(wait_for_the_loop, "{}", {})

    assert asyncio.run(call()) == "ran beside the loop"


def test_an_async_tool_is_awaited_on_the_loop():
    async def loop_name(task) -> str:
        """The running loop's task."""
        return f"{task}:{asyncio.get_running_loop() is not None}"

    assert asyncio.run(call_tool(loop_name, "{}", {"task": "T"})) == "T:True"


def test_a_tools_content_parts_become_its_messages_content_and_anything_else_its_text():
    def picture() -> list:
        """A picture and its caption."""
        url = vf.ImageUrlSource(url="data:image/png;base64,AAAA")
        return [vf.ImageUrlContentPart(image_url=url), vf.TextContentPart(text="a square")]

    assert asyncio.run(call_tool(picture, "{}", {})) == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "a square"},
    ]
    assert message_content(["a", "b"]) == "['a', 'b']" and message_content([]) == "[]" and message_content(7) == "7"


def test_an_mcp_tools_image_reaches_the_tool_message_as_an_image_part():
    class Connection:  # verifiers' MCP connection, its client answering with an image block
        async def run(self, operation):
            image = SimpleNamespace(type="image", mime_type="image/png", data="AAAA")
            client = SimpleNamespace(
                call_tool=lambda name, arguments: asyncio.sleep(0, SimpleNamespace(content=[image]))
            )
            return await operation(client)

    content = asyncio.run(call_mcp_tool({"s": Connection()}, {"s_look": ("s", "look")}, "s_look", "{}"))
    assert content == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
