"""The orchestrator's calls to the inference server's admin routes: readiness and weight reloads."""

import asyncio
import time
from pathlib import Path

import httpx

from rl.errors import TridentError


class InferenceClient:
    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll ``/health`` until the server answers 200."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if (await self.http.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TridentError(f"inference server at {self.base_url} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(1.0)

    async def reload_weights(self, path: Path, step: int) -> float:
        """Make the server serve the weights in ``path`` (trainer step ``step``); returns seconds taken."""
        response = await self.http.post("/reload_weights", json={"path": str(path.resolve()), "step": step})
        if response.status_code != 200:
            raise TridentError(f"inference server failed to reload {path}: {response.text}")
        served = (await self.http.get("/weights")).json()
        if served.get("step") != step:
            raise TridentError(f"inference server reports weights step {served.get('step')} after loading {step}")
        return response.json()["seconds"]

    async def close(self) -> None:
        await self.http.aclose()
