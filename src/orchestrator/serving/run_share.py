"""A named run's share of the inference servers it shares with other runs, as metrics of each step.

Each server counts, per named run, the requests it admits at once (``limit``, the run's fair share of its request
slots), those in flight, and, since the run first reached it, the requests it got and the seconds they waited for a
slot (``GET /runs``, :class:`~contracts.inference_api.RunShare`). A step's metrics are the run's entries on all its
servers summed, the counters as differences from the previous step's end.
"""

import asyncio
import logging

import httpx

from contracts.inference_api import RunShare
from orchestrator.serving.servers import Servers

logger = logging.getLogger("orchestrator")


def share_metrics(before: dict[str, RunShare], now: dict[str, RunShare]) -> dict[str, float]:
    """``share/*`` of a step from the run's entries on its servers (by URL) at its end (``now``) and at the previous
    step's end (``before``): requests in flight and the most admitted at once, summed over the servers, and the
    seconds its requests waited at the servers and the requests they got during the step. A counter below its value
    before (the server restarted, or evicted the run) counts from 0. No metric when no server reports the run."""
    if not now:
        return {}

    def during(counter: str) -> float:
        total = 0.0
        for url, share in now.items():
            value, previous = getattr(share, counter), getattr(before[url], counter) if url in before else 0
            total += value - previous if value >= previous else value
        return total

    return {
        "share/in_flight": sum(share.in_flight for share in now.values()),
        "share/limit": sum(share.limit for share in now.values()),
        "share/wait_s": during("waited_s"),
        "share/requests": during("requests"),
    }


class ShareMeter:
    """The ``share/*`` metrics of each step of a named run on ``servers`` (none for an unnamed run, nor from a
    server that does not answer ``GET /runs``, an older one)."""

    def __init__(self, servers: Servers):
        self.servers = servers
        self.last: dict[str, RunShare] = {}  # each server's entry at the last reading

    async def read(self) -> dict[str, RunShare]:
        """The run's entry on each server in use that has one (and answers within ``client.stall_timeout_s``)."""
        if not self.servers.run:
            return {}
        up, timeout_s = self.servers.up, self.servers.stall_timeout_s
        answers = await asyncio.gather(*(server.client.run_share(timeout_s) for server in up), return_exceptions=True)
        shares = {}
        for server, answer in zip(up, answers, strict=True):
            if isinstance(answer, RunShare):
                shares[server.url] = answer
            elif isinstance(answer, httpx.HTTPError | ValueError):  # a metric is not worth failing the run for
                logger.debug(f"no share metrics from {server.url}: {answer!r}")
            elif isinstance(answer, BaseException):
                raise answer
        return shares

    async def start(self) -> None:
        """Take the counters as they are before the run's first step (a resumed run's go on from before)."""
        self.last = await self.read()

    async def step_metrics(self) -> dict[str, float]:
        """The ``share/*`` metrics of the step that has just ended."""
        now = await self.read()
        metrics = share_metrics(self.last, now)
        self.last |= now
        return metrics
