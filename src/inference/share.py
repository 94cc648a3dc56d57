"""Each named run's generation requests pass through its fair share of the server (``inference.runs``)."""

import json

from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from contracts.inference_api import GENERATION_ROUTES, RUN_HEADER, adapter_run
from contracts.shared_config import RunId
from inference.exclusive import read_body
from inference.runs import Runs

RUN_ID = TypeAdapter(RunId)


def request_run(headers: list[tuple[bytes, bytes]], body: bytes) -> str | None:
    """The named run a generation request comes from: its ``X-Trident-Run`` header, else the run in the adapter
    name it asks for (``model``); None for the unnamed run (or a header that is no run id)."""
    header = RUN_HEADER.lower().encode()
    run = next((value.decode("latin-1") for key, value in headers if key.lower() == header), None)
    if run is None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        run = adapter_run(data.get("model")) if isinstance(data, dict) and isinstance(data.get("model"), str) else None
    try:
        return RUN_ID.validate_python(run) if run is not None else None
    except ValidationError:
        return None


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
        body, receive = await read_body(receive)
        run = request_run(scope["headers"], body)
        if run is None:
            await self.app(scope, receive, send)
            return
        async with self.runs.share(run):
            await self.app(scope, receive, send)
