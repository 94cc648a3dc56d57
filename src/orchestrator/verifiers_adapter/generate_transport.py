"""Verifiers' training client reaches the server over aiohttp instead of the OpenAI SDK and httpx.

verifiers 0.4.0's ``TrainClient`` hands an ``AsyncOpenAI`` client to ``renderers.client.generate``, which makes two
calls with it: ``post`` of ``/inference/v1/generate`` (the body a dict, the reply's bytes read back) and, once per
server and model, ``get`` of ``/models``. At hundreds of rollouts in flight the SDK's request building and httpx's
connection pool (which checks every open connection at each request's end) were half the orchestrator's CPU per
model turn. :class:`GenerateTransport` makes the same two calls with one aiohttp session per event loop, and
raises verifiers' ``ProviderError`` with the status the SDK's error would have carried (the server's own, 503
when it cannot be reached, 504 on a timeout), so retries and error records are unchanged.

:func:`~orchestrator.verifiers_adapter.patches.install_patches` puts
:class:`GenerateTransport` as verifiers' ``build_async_openai`` in place.
"""

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic_core import from_json, to_json
from verifiers.v1.configs.client import BaseClientConfig, resolve_api_key, resolve_headers
from verifiers.v1.errors import model_error

CONNECTIONS = 1000  # open connections per server at most, as verifiers' httpx pool allows


@dataclass
class Reply:
    """What ``generate`` reads of a reply: its body."""

    content: bytes


class GenerateTransport:
    """The part of ``AsyncOpenAI`` that ``renderers.client.generate`` uses, over aiohttp."""

    def __init__(self, config: BaseClientConfig):
        self.base_url = config.base_url
        self.headers = {"Authorization": f"Bearer {resolve_api_key(config)}", **resolve_headers(config)}
        timeout = config.timeout
        self.timeout = aiohttp.ClientTimeout(connect=timeout.connect, sock_read=timeout.read)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        """This event loop's session (a client can outlive the loop it first ran in, e.g. across tests)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=CONNECTIONS)
            self._session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout, connector=connector)
            self._loop = loop
        return self._session

    def _url(self, path: str) -> str:
        return path if "://" in path else self.base_url.rstrip("/") + path

    async def _request(self, method: str, path: str, data: bytes | None, headers: dict[str, str] | None) -> bytes:
        try:
            async with self._http().request(method, self._url(path), data=data, headers=headers) as response:
                content = await response.read()
        except TimeoutError as e:
            raise model_error(f"Request timed out: {e}", status_code=504) from e
        except aiohttp.ClientError as e:
            raise model_error(f"Connection error: {type(e).__name__}: {e}", status_code=503) from e
        if response.status >= 400:
            text = content.decode(errors="replace")
            raise model_error(f"Error code: {response.status} - {text}", status_code=response.status)
        return content

    async def post(self, path: str, *, cast_to: Any = None, body: dict, options: dict | None = None) -> Reply:
        """POST ``body`` as JSON to ``path`` (absolute, or under ``base_url``), with ``options["headers"]``."""
        headers = {"Content-Type": "application/json", **((options or {}).get("headers") or {})}
        return Reply(await self._request("POST", path, to_json(body), headers))

    async def get(self, path: str, *, cast_to: Any = None) -> Any:
        """GET ``path`` under ``base_url``, its JSON parsed."""
        return from_json(await self._request("GET", path, None, None))

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
