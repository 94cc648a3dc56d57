"""A token-in/token-out inference server that answers at once from a script, run as a process of its own so that
a benchmark's CPU time is the client's alone.

``python benchmarks/scripted_server.py --tool-calls N`` prints ``port <P>`` once it listens on 127.0.0.1:P.
``POST /inference/v1/generate`` (what verifiers' training client calls) answers, while the prompt holds fewer than
N tool responses, a calculator call, then a final answer, as the tiny model's token ids, each with logprob -1.
``GET /v1/models`` names the tiny model. ``POST /record`` starts keeping the generate requests' bodies;
``GET /recorded`` returns them as a JSON list and stops keeping them.
"""

import argparse
import asyncio
import json

from aiohttp import web
from transformers import AutoTokenizer

from contracts.inference_api import GENERATE, MODELS
from contracts.model_path import TINY_MODEL_ID
from tools.tiny_model import built_model_path

TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(12 + 8) * 3"}}\n</tool_call><|im_end|>'
ANSWER = "(12 + 8) * 3 = 60\n#### 60<|im_end|>"
LOGPROB = -1.0  # of every scripted token
TOOL_RESPONSE = "<tool_response>"


def generate_response(token_ids: list[int]) -> bytes:
    """The body of vLLM's ``/inference/v1/generate`` answer sampling ``token_ids``, each with logprob -1."""
    logprobs = [{"token": f"token_id:{token}", "logprob": LOGPROB} for token in token_ids]
    choice = {"index": 0, "token_ids": token_ids, "logprobs": {"content": logprobs}, "finish_reason": "stop"}
    return json.dumps({"request_id": "scripted", "choices": [choice]}).encode()


def scripted_app(tool_calls: int) -> web.Application:
    """The server's routes, answering for the tiny model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(built_model_path(TINY_MODEL_ID))
    tool_response_id = tokenizer.convert_tokens_to_ids(TOOL_RESPONSE)
    call = generate_response(tokenizer.encode(TOOL_CALL, add_special_tokens=False))
    answer = generate_response(tokenizer.encode(ANSWER, add_special_tokens=False))
    models = {"object": "list", "data": [{"id": TINY_MODEL_ID, "object": "model"}]}
    recorded: list[dict] | None = None

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        if recorded is not None:
            recorded.append(body)
        reply = call if body["token_ids"].count(tool_response_id) < tool_calls else answer
        return web.Response(body=reply, content_type="application/json")

    async def served_models(request: web.Request) -> web.Response:
        return web.json_response(models)

    async def record(request: web.Request) -> web.Response:
        nonlocal recorded
        recorded = []
        return web.json_response({})

    async def recorded_bodies(request: web.Request) -> web.Response:
        nonlocal recorded
        bodies, recorded = recorded or [], None
        return web.json_response(bodies)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post(GENERATE, generate)
    app.router.add_get(MODELS, served_models)
    app.router.add_post("/record", record)
    app.router.add_get("/recorded", recorded_bodies)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool-calls", type=int, required=True, help="calculator calls before the answer")
    app = scripted_app(parser.parse_args(argv).tool_calls)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=4096).start()
        print(f"port {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()  # until the benchmark stops this process

    asyncio.run(serve())


if __name__ == "__main__":
    main()
