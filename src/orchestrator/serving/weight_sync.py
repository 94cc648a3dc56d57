"""Keeping the servers on weights fresh enough: the rollouts of step N sample from weights no older than
N - 1 - ``async_level`` (steps and weights are numbered as docs/protocol.md says). Each new weights folder of the
trainer is loaded into every server and probe-checked; a server that comes back (restarted on its base model) gets
the run's weights again before it gets work.
"""

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from contracts.delta_chain import chain_start
from contracts.progress import Progress, last_written
from contracts.run_dir import latest_stable_weights, wait_for, weights_dir
from orchestrator.serving.servers import Servers

logger = logging.getLogger("orchestrator")


class WeightSync:
    """The weights the run's ``servers`` serve (``served_step``, 0 for the base model), moved to the trainer's
    newest in ``output_dir/weights`` as steps need them. ``before_reload`` runs before each reload (the evaluation
    of the weights served until then ends first)."""

    def __init__(
        self,
        output_dir: Path,
        servers: Servers,
        progress: Progress,
        timeout_s: float,
        probe_tolerance: float | None,
        before_reload: Callable[[], Awaitable[None]],
        in_flight: bool = False,
    ):
        self.output_dir, self.servers, self.progress = output_dir, servers, progress
        self.timeout_s, self.probe_tolerance = timeout_s, probe_tolerance
        self.before_reload = before_reload
        for server in servers.servers:  # [weight_sync] in_flight: reloads keep the requests in flight
            server.client.in_flight = in_flight
        self.served_step = 0
        self.probe_gap: float | None = None  # mean |logprob difference| on the probe after the last reload
        self.paused_s = 0.0  # seconds generation was paused for the last reload (the longest of the servers')

    async def bring_servers_back(self) -> None:
        """Make every server that answers serve ``served_step`` (:meth:`Servers.bring_to`)."""
        served = weights_dir(self.output_dir, self.served_step) if self.served_step else None
        await self.servers.bring_to(served, self.served_step, self.probe_tolerance)

    async def update(self, needed: int) -> tuple[float, float]:
        """Serve the newest weights, waiting for weights step ``needed`` or newer; returns (seconds waited, seconds
        reloading)."""
        start = time.perf_counter()
        if needed > self.served_step:
            with self.progress.doing(f"waiting for the trainer's weights step {needed}"):
                await asyncio.to_thread(
                    wait_for,
                    lambda: latest_stable_weights(self.output_dir) >= needed,
                    self.timeout_s,
                    f"the trainer's weights {weights_dir(self.output_dir, needed)}/STABLE",
                    sign_of_life=lambda: last_written(self.output_dir, "trainer"),
                )
        waited = time.perf_counter() - start
        newest = latest_stable_weights(self.output_dir)
        if newest <= self.served_step:
            self.paused_s = 0.0
            return waited, 0.0
        await self.before_reload()
        path = weights_dir(self.output_dir, newest)
        with self.progress.doing(f"loading weights step {newest} into the server"):
            reload_s, gap = await self.servers.reload_weights(path, newest, self.probe_tolerance)
        self.probe_gap = gap
        self.paused_s = max((server.client.paused_s for server in self.servers.up), default=0.0)
        count = len(self.servers.up)
        which = "server now serves" if len(self.servers.servers) == 1 else f"all {count} servers serve"
        logger.info(
            f"{which} weights step {newest} (reload {reload_s:.3f}s, generation paused {self.paused_s:.3f}s, "
            f"probe gap {gap})"
        )
        # Nothing can ask for older weights any more: the server moved past them. The folder served until now
        # goes at the next swap (requests admitted under a retired adapter may still read it); a delta chain's stay
        # from its full copy on (a restarted server replays them).
        kept_from = chain_start(path)
        for old in range(1, newest if kept_from is None else kept_from):
            if old != self.served_step:
                shutil.rmtree(weights_dir(self.output_dir, old), ignore_errors=True)
        self.served_step = newest
        return waited, reload_s
