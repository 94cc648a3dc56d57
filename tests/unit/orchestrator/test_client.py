import asyncio
import logging

import httpx

from orchestrator.client import InferenceClient


def test_wait_ready_says_it_is_still_waiting_until_the_server_answers(caplog):
    answers = iter([503, 503, 200])
    client = InferenceClient("http://server", timeout_s=1)
    client.http = httpx.AsyncClient(
        base_url="http://server", transport=httpx.MockTransport(lambda request: httpx.Response(next(answers)))
    )
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        asyncio.run(client.wait_ready(timeout_s=60, notice_s=0.5))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("still waiting for the inference server at http://server (") for m in messages)
    assert messages[-1].startswith("inference server ready after")
