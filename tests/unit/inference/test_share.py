import asyncio
import json

import pytest

from contracts.inference_api import RUN_HEADER, adapter_name
from inference.runs import Runs
from inference.share import FairShare, request_run


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ([(RUN_HEADER.lower().encode(), b"lr=1e-05")], {"model": "trident/tiny-qwen3"}, "lr=1e-05"),
        ([(b"x-trident-run", b"a")], {"model": adapter_name(3, "b")}, "a"),  # the header wins
        ([], {"model": adapter_name(3, "b")}, "b"),  # no header: the run of the adapter it names
        ([], {"model": adapter_name(3)}, None),  # the unnamed run's adapter
        ([], {"model": "trident/tiny-qwen3"}, None),
        ([(b"x-trident-run", b"../etc")], {}, None),  # no run id
        ([], [1, 2], None),
    ],
)
def test_a_requests_run_is_its_header_or_its_adapters(headers, body, expected):
    assert request_run(headers, json.dumps(body).encode()) == expected


class Engine:
    """An ASGI app standing in for vLLM's routes: each request (JSON ``{"id"}``, or an OpenAI chat request whose
    message is its id) is answered in two chunks, the second once the test lets it go (``finish``); ``started`` lists
    the requests in the order they came in; ``bodies`` and ``headers``, what each sent (the body read whole, in as
    many chunks as it came)."""

    def __init__(self):
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.bodies: dict[str, dict] = {}
        self.headers: dict[str, list[tuple[bytes, bytes]]] = {}

    async def __call__(self, scope, receive, send):
        chunks = [await receive()]
        while chunks[-1].get("more_body", False):
            chunks.append(await receive())
        body = json.loads(b"".join(chunk["body"] for chunk in chunks))
        request = body["id"] if "id" in body else body["messages"][0]["content"]
        self.bodies[request], self.headers[request] = body, scope["headers"]
        self.started.append(request)
        self.release[request] = asyncio.Event()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})  # streaming
        await self.release[request].wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def finish(self, request: str) -> None:
        self.release[request].set()
        await settle()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def until(condition) -> None:
    """Let the event loop run until ``condition()`` holds (a request through an HTTP client takes more turns)."""
    for _ in range(10_000):
        if condition():
            break
        await asyncio.sleep(0)
    await settle()


class Server:
    """:class:`FairShare` over :class:`Engine` with ``slots`` shared by the named runs."""

    def __init__(self, slots: int):
        self.runs = Runs("/base", None, slots=slots, max_named=4, idle_timeout_s=60)
        self.engine = Engine()
        self.app = FairShare(self.engine, self.runs)
        self.replies: dict[str, list[bytes]] = {}

    def send(self, request: str, run: str | None, path: str = "/inference/v1/generate") -> asyncio.Task:
        headers = [(b"x-trident-run", run.encode())] if run else []
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        messages = [{"type": "http.request", "body": json.dumps({"id": request}).encode()}]

        async def receive():
            return messages.pop(0) if messages else await asyncio.Event().wait()

        async def send(message):
            self.replies.setdefault(request, []).append(message.get("body", b""))

        return asyncio.ensure_future(self.app(scope, receive, send))

    def share(self, run: str) -> tuple[int, int, int]:
        """``run``'s (in flight, limit, waiting)."""
        share = self.runs.shares()[run]
        return share.in_flight, share.limit, share.waiting


def test_each_named_run_gets_its_share_of_the_slots_and_the_rest_wait_in_order():
    async def scenario():
        server = Server(slots=4)
        for i in range(3):
            server.send(f"a{i}", "a")
        await settle()
        assert server.share("a") == (3, 4, 0)  # alone: every slot
        for i in range(4):
            server.send(f"b{i}", "b")
        await settle()
        assert server.share("b") == (2, 2, 2)  # two active runs: half each; the rest wait
        server.send("a3", "a")
        await settle()
        assert server.share("a") == (3, 2, 1)  # over its new share: its next request waits, though it came first
        for i in range(5):
            server.send(f"u{i}", None)  # the unnamed run is not limited
        await settle()
        assert [r for r in server.engine.started if r.startswith("u")] == [f"u{i}" for i in range(5)]
        await server.engine.finish("b0")
        assert server.share("b") == (2, 2, 1) and server.engine.started[-1] == "b2"  # in order
        await server.engine.finish("a0")
        assert server.share("a") == (2, 2, 1)  # still at its share
        await server.engine.finish("a1")
        assert server.share("a") == (2, 2, 0) and server.engine.started[-1] == "a3"
        for request in ["a2", "a3"]:
            await server.engine.finish(request)
        assert server.share("a") == (0, 2, 0)
        assert server.share("b") == (3, 4, 0)  # a went quiet: b may take every slot now (b1, b2, b3)
        assert server.engine.started[-1] == "b3"
        assert server.runs.shares()["a"].requests == 4 and server.runs.shares()["a"].waited_s > 0
        assert server.replies["a0"] == [b"", b"data: 1\n\n", b"data: [DONE]\n\n"]  # the whole stream went out

    asyncio.run(scenario())


def test_a_stream_holds_its_slot_until_its_last_chunk():
    async def scenario():
        server = Server(slots=1)
        server.send("a0", "a")
        server.send("a1", "a")
        await settle()
        assert server.replies["a0"][-1] == b"data: 1\n\n"  # streaming
        assert server.share("a") == (1, 1, 1)
        await server.engine.finish("a0")
        assert server.share("a") == (1, 1, 0) and server.engine.started == ["a0", "a1"]

    asyncio.run(scenario())


def test_a_request_whose_client_leaves_while_waiting_gives_up_its_place():
    async def scenario():
        server = Server(slots=1)
        server.send("a0", "a")
        gone = server.send("a1", "a")
        server.send("a2", "a")
        await settle()
        gone.cancel()
        await settle()
        assert server.share("a") == (1, 1, 1)
        await server.engine.finish("a0")
        assert server.engine.started == ["a0", "a2"] and server.share("a") == (1, 1, 0)

    asyncio.run(scenario())


def test_releasing_a_run_lets_its_waiting_requests_go_and_forgets_it():
    async def scenario():
        server = Server(slots=2)
        for request in ["a0", "b0", "a1"]:
            server.send(request, request[0])
        await settle()
        assert server.share("a") == (1, 1, 1)
        assert await server.runs.release("a")
        await settle()
        assert server.engine.started[-1] == "a1"  # it goes on (to find its adapter gone)
        assert set(server.runs.shares()) == {"b"} and server.share("b") == (1, 2, 0)
        assert not await server.runs.release("a")

    asyncio.run(scenario())


def test_other_routes_pass_unshared():
    async def scenario():
        server = Server(slots=1)
        server.send("a0", "a")
        server.send("a1", "a", path="/weights")
        await settle()
        assert server.engine.started == ["a0", "a1"] and server.share("a") == (1, 1, 0)

    asyncio.run(scenario())


def test_a_run_is_evicted_only_once_idle_with_nothing_in_flight():
    async def scenario():
        server = Server(slots=2)
        now = [0.0]
        server.runs.clock = lambda: now[0]
        server.send("a0", "a")
        server.send("b0", "b")
        await settle()
        await server.engine.finish("b0")
        now[0] = 61.0  # a's request is still generating
        assert await server.runs.evict_idle() == ["b"]
        await server.engine.finish("a0")
        now[0] = 100.0
        assert await server.runs.evict_idle() == []  # 39 s since its request ended
        now[0] = 122.0
        assert await server.runs.evict_idle() == ["a"] and server.runs.shares() == {}

    asyncio.run(scenario())


def test_a_request_that_names_its_run_only_in_the_adapter_it_asks_for_counts_in_that_runs_share():
    """As a plain OpenAI client sends it (the openai package, over HTTP to the ASGI app): the run is named only in
    ``model``, no run header, the body in chunks; the runs have loaded their adapters (``/load_adapter``)."""
    import httpx
    import openai

    async def scenario():
        server = Server(slots=2)
        for run in ["a", "b"]:
            server.runs.for_adapter(run)  # as /load_adapter does
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app))
        client = openai.AsyncOpenAI(base_url="http://server/v1", api_key="key", http_client=http, max_retries=0)

        replies = []

        def arrived() -> int:
            return len(server.engine.started) + sum(share.waiting for share in server.runs.shares().values())

        async def ask(request: str, model: str) -> None:
            """Send ``request`` asking for ``model``, and let it arrive (started, or waiting for its share)."""
            create = client.chat.completions.with_raw_response.create
            messages = [{"role": "user", "content": request}]
            count = arrived()
            replies.append(asyncio.ensure_future(create(model=model, messages=messages, max_tokens=4, stream=False)))
            await until(lambda: arrived() > count)

        for request in ["b0", "b1", "b2"]:
            await ask(request, "b/lora-step-3")
        assert server.share("b") == (2, 2, 1) and server.engine.started == ["b0", "b1"]
        assert server.engine.bodies["b0"]["model"] == "b/lora-step-3"  # the body read for the share went on whole
        assert not any(key == RUN_HEADER.lower().encode() for key, _ in server.engine.headers["b0"])
        await ask("a0", "a/lora-step-3")
        for request in ["u0", "u1", "u2"]:
            await ask(request, "trident/tiny-qwen3")  # the base model: no run's share
        assert server.share("a") == (1, 1, 0) and server.share("b") == (2, 1, 1)
        assert server.engine.started == ["b0", "b1", "a0", "u0", "u1", "u2"]
        await server.engine.finish("b0")
        assert server.share("b") == (1, 1, 1) and server.engine.started[-1] == "u2"  # over its share now: b2 waits
        await server.engine.finish("b1")
        await until(lambda: server.engine.started[-1] == "b2")
        assert server.share("b") == (1, 1, 0)
        for request in ["b2", "a0", "u0", "u1", "u2"]:
            await server.engine.finish(request)
        await asyncio.gather(*replies)
        assert server.runs.shares()["b"].requests == 3 and server.runs.shares()["a"].requests == 1

    asyncio.run(scenario())
