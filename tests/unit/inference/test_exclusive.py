import asyncio
import json

import httpx
import pytest

from inference.exclusive import PromptLogprobsAlone, asks_prompt_logprobs


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}, True),
        ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 8, "logprobs": 1}}, False),
        ({"messages": [], "prompt_logprobs": 1}, True),
        ({"prompt": "hi", "echo": True, "logprobs": 1}, True),
        ({"prompt": "hi", "echo": True}, False),
        ({"messages": [], "prompt_logprobs": None}, False),
    ],
)
def test_asks_prompt_logprobs_reads_each_routes_field(body, expected):
    assert asks_prompt_logprobs(json.dumps(body).encode()) is expected


def test_not_json_asks_for_nothing():
    assert not asks_prompt_logprobs(b"{not json") and not asks_prompt_logprobs(b"[1, 2]")


class Engine:
    """An ASGI app standing in for vLLM's routes: each request stays in the batch for a while; it records the
    largest batch each kind of request shared, and echoes the body it received."""

    def __init__(self):
        self.batch: list[str] = []
        self.shared_with: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        message = await receive()
        body = json.loads(message["body"])
        self.batch.append(body["id"])
        for _ in range(5):
            self.shared_with[body["id"]] = max(self.shared_with.get(body["id"], 0), len(self.batch))
            await asyncio.sleep(0.01)
        self.batch.remove(body["id"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def test_a_prompt_logprobs_request_runs_alone_and_the_others_together():
    engine = Engine()
    transport = httpx.ASGITransport(app=PromptLogprobsAlone(engine))

    async def requests():
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:

            async def post(path: str, body: dict) -> dict:
                response = await client.post(path, json=body)
                return response.json()

            rollouts = [post("/inference/v1/generate", {"id": f"r{i}", "sampling_params": {}}) for i in range(6)]
            probe = post("/inference/v1/generate", {"id": "probe", "sampling_params": {"prompt_logprobs": 0}})
            chats = [post("/v1/chat/completions", {"id": f"c{i}"}) for i in range(2)]
            return await asyncio.gather(*rollouts[:3], probe, *rollouts[3:], *chats)

    replies = asyncio.run(requests())
    assert [reply["id"] for reply in replies] == ["r0", "r1", "r2", "probe", "r3", "r4", "r5", "c0", "c1"]
    assert engine.shared_with["probe"] == 1  # alone in its batch
    assert max(engine.shared_with.values()) > 1  # the others shared theirs
