"""The inference servers a run samples from (``client.base_url``, one or several).

Every server gets each weight update and is probe-checked, so a step samples only from servers that serve its
weights. Rollouts are spread over them a group at a time: a group's rollouts share a prompt, which stays in one
server's prefix cache; a new group goes to the server with the fewest groups in flight.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import verifiers.v1 as vf

from orchestrator.client import InferenceClient


class Servers:
    def __init__(self, urls: list[str], timeout_s: float, model: str, ctx: vf.ModelContext):
        self.clients = [InferenceClient(url, timeout_s, model) for url in urls]
        self.ctx = ctx  # how verifiers reaches a server; each lease points it at one
        self.in_flight = [0] * len(urls)  # groups running on each server
        self.rollouts = [0] * len(urls)  # rollouts each server was given, since the last reset_counts()

    def context(self, index: int) -> vf.ModelContext:
        """The model context that samples from server ``index`` (the name it serves the policy under)."""
        client = self.clients[index]
        endpoint = self.ctx.client.model_copy(update={"base_url": f"{client.base_url}/v1"})
        return dataclasses.replace(self.ctx, model=client.model, client=endpoint)

    @asynccontextmanager
    async def lease(self, rollouts: int) -> AsyncIterator[vf.ModelContext]:
        """The model context of the least loaded server, held while a group of ``rollouts`` runs on it."""
        index = min(range(len(self.clients)), key=self.in_flight.__getitem__)
        self.in_flight[index] += 1
        self.rollouts[index] += rollouts
        try:
            yield self.context(index)
        finally:
            self.in_flight[index] -= 1

    def reset_counts(self) -> list[int]:
        """Rollouts given to each server since the last call."""
        counts, self.rollouts = self.rollouts, [0] * len(self.clients)
        return counts

    async def wait_ready(self, timeout_s: float) -> None:
        await asyncio.gather(*(client.wait_ready(timeout_s) for client in self.clients))

    async def reset_weights(self) -> None:
        await asyncio.gather(*(client.reset_weights() for client in self.clients))

    async def reload_weights(self, path: Path, step: int, tolerance: float) -> tuple[float, float | None]:
        """Every server loads the weights in ``path`` and is probe-checked (:meth:`InferenceClient.check_probe`);
        returns the slowest reload's seconds and the largest probe gap (None without a probe)."""
        seconds = await asyncio.gather(*(client.reload_weights(path, step) for client in self.clients))
        gaps = await asyncio.gather(*(client.check_probe(path, step, tolerance) for client in self.clients))
        return max(seconds), None if gaps[0] is None else max(gaps)

    async def served(self) -> list[dict | None]:
        """What each server says it serves (None for one that cannot be reached)."""
        return list(await asyncio.gather(*(client.served() for client in self.clients)))

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients))
