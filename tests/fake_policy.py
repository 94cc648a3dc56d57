"""A local HTTP server in the place of the inference server: the policy (``/inference/v1/generate``) always replies
"hi" in the tiny model's tokens; subclasses of its handler answer more (:class:`CountingServer` counts the requests in
flight). :func:`rollouts_of` runs a group of an environment's rollouts against one."""

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from transformers import AutoTokenizer

from contracts.inference_api import GENERATE, MODELS
from contracts.model_path import TINY_MODEL_ID
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.tiny_model import built_model_path


class FakePolicy(ThreadingHTTPServer):
    """Serves ``handler``'s answers on a free local port; ``hi`` is the policy's reply."""

    daemon_threads = True

    def __init__(self, handler: type["PolicyHandler"]):
        super().__init__(("127.0.0.1", 0), handler)
        tokenizer = AutoTokenizer.from_pretrained(built_model_path(TINY_MODEL_ID))
        ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
        logprobs = [{"token": f"token_id:{token}", "logprob": -1.0} for token in ids]
        choice = {"index": 0, "token_ids": ids, "logprobs": {"content": logprobs}, "finish_reason": "stop"}
        self.hi = {"request_id": "hi", "choices": [choice]}

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class PolicyHandler(BaseHTTPRequestHandler):
    """Answers ``GET /v1/models`` with the tiny model and :meth:`respond` s JSON; no log lines."""

    protocol_version = "HTTP/1.1"
    server: FakePolicy

    def do_GET(self) -> None:
        self.respond(200, {"object": "list", "data": [{"id": TINY_MODEL_ID}]} if self.path == MODELS else {})

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def respond(self, status: int, body: dict) -> None:
        content = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def log_message(self, format: str, *args) -> None:
        pass


@contextmanager
def serving(server: FakePolicy) -> Iterator[FakePolicy]:
    """``server`` answering in a thread until the block ends."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class CountingServer(FakePolicy):
    """Answers ``/inference/v1/generate`` with "hi" after ``delay_s``, counting the requests in flight."""

    def __init__(self, delay_s: float):
        super().__init__(CountingHandler)
        self.delay_s, self.in_flight, self.peak, self.lock = delay_s, 0, 0, threading.Lock()


class CountingHandler(PolicyHandler):
    server: CountingServer

    def do_POST(self) -> None:
        self.read_json()
        assert self.path == GENERATE, self.path
        with self.server.lock:
            self.server.in_flight += 1
            self.server.peak = max(self.server.peak, self.server.in_flight)
        time.sleep(self.server.delay_s)
        with self.server.lock:
            self.server.in_flight -= 1
        self.respond(200, self.server.hi)


def counting_server(delay_s: float = 0.0) -> AbstractContextManager[CountingServer]:
    return serving(CountingServer(delay_s))


def rollouts_of(env_id: str, url: str, n: int, limits: RolloutLimits, **env):
    env = load_env(EnvConfig(id=env_id, **env))
    ctx = model_context(OrchestratorConfig(client={"base_url": url}), built_model_path(TINY_MODEL_ID))

    async def run():
        async with env.serving():
            return await run_group(env, next(iter(env.taskset.load())), n, ctx, limits)

    return asyncio.run(run())
