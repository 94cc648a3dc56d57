"""Each named run's generation requests pass through its fair share of the server (``inference.runs``)."""

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from contracts.inference_api import GENERATION_ROUTES, RUN_HEADER, adapter_run
from contracts.shared_config import is_run_id
from inference.exclusive import read_body
from inference.runs import Runs


def header_run(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The run a request's ``X-Trident-Run`` header names (None: no header, or no run id)."""
    header = RUN_HEADER.lower().encode()
    return valid_run(next((value.decode("latin-1") for key, value in headers if key.lower() == header), None))


def model_run(body: bytes) -> str | None:
    """The run in the adapter name a request's body asks for (``model``; None: no named run's adapter)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return valid_run(adapter_run(model) if isinstance(model, str) else None)


def valid_run(run: str | None) -> str | None:
    return run if run is not None and is_run_id(run) else None


def request_run(headers: list[tuple[bytes, bytes]], body: bytes) -> str | None:
    """The named run a generation request comes from: its ``X-Trident-Run`` header, else the run in the adapter
    name it asks for (``model``); None for the unnamed run (or a header that is no run id)."""
    return header_run(headers) or model_run(body)


class FairShare:
    """ASGI middleware: a named run's generation request holds one of the run's slots in ``runs`` (waiting for it
    in order) until its whole reply, a stream's last chunk too, is sent; other requests pass."""

    def __init__(self, app: ASGIApp, runs: Runs):
        self.app = app
        self.runs = runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_ROUTES:
            await self.app(scope, receive, send)
            return
        run = header_run(scope["headers"])
        if run is None and self.runs.named():  # no header: the request may name a run's adapter (read its body)
            body, receive = await read_body(receive)
            run = model_run(body)
        if run is None:
            await self.app(scope, receive, send)
            return
        async with self.runs.share(run):
            await self.app(scope, receive, send)
