"""The orchestrator's calls to the inference server's admin routes: readiness, weight reloads and their check."""

import asyncio
import logging
import time
from pathlib import Path

import httpx

from rl.errors import TridentError
from rl.protocol import adapter_name, auth_headers, is_adapter, read_probe

logger = logging.getLogger("orchestrator")

NOTICE_S = 30.0  # how often to say that the server is still not up


class InferenceClient:
    def __init__(self, base_url: str, timeout_s: float, model: str = ""):
        self.base_url = base_url.rstrip("/")
        self.base_model = model
        self.model = model  # the name the policy is served under: the base model's, or the current adapter's
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, headers=auth_headers())

    async def wait_ready(self, timeout_s: float, notice_s: float = NOTICE_S) -> None:
        """Poll ``/health`` until the server answers 200, backing off from 1 s to 10 s between tries and logging
        every ``notice_s`` that it is still not up."""
        start = time.monotonic()
        notice = start + notice_s
        delay = 1.0
        while True:
            try:
                if (await self.http.get("/health")).status_code == 200:
                    logger.info(f"inference server ready after {time.monotonic() - start:.0f}s")
                    return
            except httpx.TransportError:
                pass
            now = time.monotonic()
            if now - start > timeout_s:
                raise TridentError(f"inference server at {self.base_url} not ready after {timeout_s:.0f}s")
            if now >= notice:
                logger.info(f"still waiting for the inference server at {self.base_url} ({now - start:.0f}s)")
                notice = now + notice_s
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def served(self, timeout_s: float | None = None) -> dict:
        """What the server says it serves (``GET /weights``: step, path, adapter); an ``httpx.HTTPError`` when it
        cannot be reached or stays silent for ``timeout_s`` (the client's timeout by default)."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        return (await self.http.get("/weights", timeout=timeout)).raise_for_status().json()

    async def reset_weights(self) -> None:
        """Make the server serve the model it started with, no adapter, as step 0: a server that an earlier run
        left on its own weights or adapter serves what a fresh one would."""
        response = await self.http.post("/reset_weights")
        if response.status_code != 200:
            raise TridentError(f"inference server failed to serve its base model again: {response.text}")
        self.use(response.json())

    def use(self, served: dict) -> None:
        """Name what ``served`` reports in requests from now on: its adapter, or the base model."""
        self.model = served.get("adapter") or self.base_model

    async def reload_weights(self, path: Path, step: int) -> float:
        """Make the server serve the weights in ``path`` (trainer step ``step``): full weights, or a LoRA adapter
        swapped in under :func:`adapter_name`, which becomes :attr:`model`. Returns the seconds taken."""
        adapter = adapter_name(step) if is_adapter(path) else None
        route = "/load_adapter" if adapter else "/reload_weights"
        response = await self.http.post(route, json={"path": str(path.resolve()), "step": step})
        if response.status_code != 200:
            raise TridentError(f"inference server failed to load {path} ({route}): {response.text}")
        served = (await self.http.get("/weights")).json()
        if (served.get("step"), served.get("adapter")) != (step, adapter):
            raise TridentError(
                f"inference server reports step {served.get('step')} (adapter {served.get('adapter')}) after "
                f"loading step {step} (adapter {adapter})"
            )
        self.use(served)
        return response.json()["seconds"]

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The server's logprob of each token given the ones before it (temperature 1; 0.0 at position 0)."""
        request = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        body = {"model": self.model, "token_ids": token_ids, "sampling_params": request}
        response = await self.http.post("/inference/v1/generate", json=body)
        if response.status_code != 200:
            raise TridentError(f"inference server refused the probe request: {response.text}")
        per_position = response.json()["prompt_logprobs"]
        return [0.0] + [per_position[i][str(token)]["logprob"] for i, token in enumerate(token_ids) if i > 0]

    async def check_probe(self, path: Path, step: int, tolerance: float) -> float | None:
        """Compare the server's logprobs of the probe with the trainer's for the weights in ``path``.

        Returns their mean absolute difference (None when the weights carry no probe); raises when it exceeds
        ``tolerance``: the server is not sampling from the weights the trainer wrote.
        """
        probe = read_probe(path)
        if probe is None:
            return None
        token_ids, expected = probe
        served = await self.prompt_logprobs(token_ids)
        gap = sum(abs(a - b) for a, b in zip(served[1:], expected[1:], strict=True)) / max(len(token_ids) - 1, 1)
        if gap > tolerance:
            raise TridentError(
                f"after reloading weights step {step}, the server's logprobs of the probe differ from the trainer's "
                f"by {gap:.4f} on average (tolerance client.probe_tolerance = {tolerance}): the server does not "
                f"serve the weights in {path}"
            )
        return gap

    async def close(self) -> None:
        await self.http.aclose()
