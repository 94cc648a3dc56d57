import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.errors import ProviderError

from orchestrator.verifiers_adapter.generate_transport import GenerateTransport


async def _against(routes: dict, call, monkeypatch):
    """``call(client)`` with verifiers' training client built for a real aiohttp server serving ``routes``."""
    monkeypatch.setenv("TEST_SERVER_KEY", "s3")
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    async with TestServer(app) as server:
        config = TrainClientConfig(base_url=str(server.make_url("/v1")), api_key_var="TEST_SERVER_KEY")
        client = TrainClient(config).client
        try:
            return await call(client)
        finally:
            await client.close()


def test_training_clients_post_the_body_with_their_key_and_headers_and_read_the_reply(monkeypatch):
    seen = {}

    async def generate(request):
        seen.update(body=await request.json(), auth=request.headers["Authorization"],
                    session=request.headers["X-Session"])  # fmt: skip
        return web.Response(body=b'{"choices": [{"token_ids": [1, 2]}]}', content_type="application/json")

    async def post(client):
        assert isinstance(client, GenerateTransport)
        base = str(client.base_url).removesuffix("/v1")  # renderers' generate posts to the server's root
        return await client.post(f"{base}/inference/v1/generate", cast_to=None, body={"token_ids": [5, 6]},
                                 options={"headers": {"X-Session": "r1"}})  # fmt: skip

    reply = asyncio.run(_against({("POST", "/inference/v1/generate"): generate}, post, monkeypatch))
    assert json.loads(reply.content) == {"choices": [{"token_ids": [1, 2]}]}
    assert seen == {"body": {"token_ids": [5, 6]}, "auth": "Bearer s3", "session": "r1"}


def test_models_are_read_under_the_base_url(monkeypatch):
    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 2048}]})

    payload = asyncio.run(_against({("GET", "/v1/models"): models}, lambda c: c.get("/models"), monkeypatch))
    assert payload == {"data": [{"id": "m", "max_model_len": 2048}]}


@pytest.mark.parametrize("status", [400, 429, 500])
def test_a_refusal_is_a_provider_error_with_the_servers_status_and_text(status, monkeypatch):
    async def refuse(request):
        return web.json_response({"error": "prompt too long"}, status=status)

    async def post(client):
        return await client.post(str(client.base_url) + "/generate", body={})

    with pytest.raises(ProviderError) as error:
        asyncio.run(_against({("POST", "/v1/generate"): refuse}, post, monkeypatch))
    assert error.value.status_code == status
    assert f"Error code: {status}" in str(error.value) and "prompt too long" in str(error.value)


def test_an_unreachable_server_is_a_retryable_provider_error():
    async def post():
        client = GenerateTransport(TrainClientConfig(base_url="http://127.0.0.1:9/v1", api_key_var="NO_SUCH_KEY"))
        try:
            await client.post("/generate", body={})
        finally:
            await client.close()

    with pytest.raises(ProviderError, match="Connection error") as error:
        asyncio.run(post())
    assert error.value.status_code == 503
