"""Weights sent from the trainer's memory over a two-rank process group of its own with each server's worker (the
trainer rank 0, the worker rank 1; NCCL between GPUs, gloo otherwise), met through the TCP store the trainer hosts, so
that a server that dies or comes back breaks or holds up no other."""

import itertools
import json
import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from contracts.weight_delta import to_wire
from contracts.weight_manifest import DELTA, SEND, answer_key, ask_key, asks_key
from contracts.weight_wire import TRAINER_RANK, broadcast, connect_store, pair_group
from trainer.transports.base import MemorySender
from trainer.transports.served_copy import Change, ServedCopy

logger = logging.getLogger("trainer")


class ProcessGroupSender(MemorySender):
    """Made with the first send, it hosts the store and holds the newest weights until newer ones are sent, sending
    them to each server that asks (``inference.transports.process_group``) over a group of their own, several at
    once; the orchestrator has every server load the newest, and a server that comes back asks again. Before newer
    weights replace them, the trainer waits until as many servers took them as took the weights before
    (``receivers`` the first time), at most ``timeout_s``: a server that left costs one such wait and is then no
    longer waited for; one that comes back counts again once it took weights. Weights the orchestrator never asks
    for (it finished first) are left untaken when the trainer exits.

    With ``delta`` (``[weights] delta``, not ``off``) a server that asks holding exactly the weights sent before
    (their sequence and checksum, which it sends with its ask) gets each tensor's delta against them, any other
    (just started or restarted, behind, or after a failed load) the full weights (docs/protocol.md)."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        backend: str,
        device: torch.device,
        receivers: int = 1,
        delta: str = "off",
        full_every: int = 1,
    ):
        super().__init__(host, port, timeout_s, backend)
        self.copy = None if delta == "off" else ServedCopy(delta, full_every)
        self.change = Change(None, None)  # what turns the weights sent before into the newest, with delta
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.receivers = receivers  # how many servers must take the newest weights before newer replace them
        self.newest: dict[str, Tensor] = {}
        self.takers: set[str] = set()  # receivers that took the newest weights
        self.groups: dict[str, dist.ProcessGroup] = {}  # each receiver's, by name
        self.serving: threading.Thread | None = None  # answers the servers' asks, from the first send to close

    def offer(self, tensors: dict[str, Tensor]) -> dict:
        """Hold ``tensors`` as the newest weights, sent to each server that asks; their manifest. Waits for the
        previous ones first (:meth:`wait`)."""
        self.wait()
        if self.serving is None:
            try:
                self.store = self.host_store()
            except (RuntimeError, OSError) as e:  # the port taken
                raise self.failure(e) from None
            self.serving = threading.Thread(target=self.run, args=(self._serve,), name="weight-broadcast", daemon=True)
            self.serving.start()
        change = Change(None, None) if self.copy is None else self.copy.update(tensors, self.sequence + 1)
        with self.changed:
            self.newest, self.change, self.takers, self.sequence = tensors, change, set(), self.sequence + 1
        return self.manifest(tensors, None if self.copy is None else self.copy.checksum)

    def wait(self) -> None:
        """Block until the newest weights were taken by as many servers as expected (see the class), at most
        ``timeout_s``; raise if none took them or the store failed."""
        if self.sequence:
            self._await_receivers()
        self.raise_error()

    def _await_receivers(self) -> None:
        """Wait until ``receivers`` servers took the newest weights, at most ``timeout_s``; then expect as many as
        took them."""
        with self.changed:
            enough = self.changed.wait_for(
                lambda: len(self.takers) >= self.receivers or self.error is not None, self.timeout_s
            )
            if not enough and self.takers:
                logger.warning(
                    f"weight broadcast: {len(self.takers)} of {self.receivers} inference servers took weights "
                    f"{self.sequence} within weight_broadcast.timeout_s = {self.timeout_s:.0f}s; going on without "
                    "waiting for the others (one that comes back gets newer weights when it asks)"
                )
            elif not enough:
                self.error = TimeoutError("no server asked for them")
            self.receivers = len(self.takers) or self.receivers

    def close(self) -> None:
        """Stop answering servers (a thread blocked in the store when the process exits aborts it: the last ask
        ends it); the servers keep what they took."""
        if self.serving is not None:
            session, store = self.address["session"], connect_store(self.manifest({}))  # serving holds its own
            store.set(ask_key(session, store.add(asks_key(session), 1)), "null")
            self.serving.join()
            self.serving = None

    def _serve(self) -> None:
        """Answer each receiver's ask, in turn: send it the newest weights (in a thread of their own), or tell it
        that the weights it asks for were replaced by newer ones; until the ask :meth:`close` makes."""
        session = self.address["session"]
        for ask in itertools.count(1):
            while True:
                try:
                    self.store.wait([ask_key(session, ask)], timedelta(days=1))
                    break
                except dist.DistStoreError:  # a day without an ask: wait on
                    continue
            request = json.loads(self.store.get(ask_key(session, ask)))
            if request is None:
                return
            name, sequence, held = request
            with self.changed:
                newest, change, current = self.newest, self.change, self.sequence
            if sequence != current:
                self.store.set(answer_key(session, ask), f"the trainer holds weights {current}, not {sequence}")
                continue
            if change.deltas is not None and held is not None and tuple(held) == change.base:
                header, tensors = to_wire(change.deltas)
                answer, what = DELTA + json.dumps(header).encode(), "deltas"
            else:
                tensors, answer, what = list(newest.values()), SEND, "full weights"
            self.store.set(answer_key(session, ask), answer)
            size = sum(t.numel() * t.element_size() for t in tensors)
            logger.info(f"weight broadcast: weights {sequence} to a server as {what} ({size} bytes)")
            threading.Thread(target=self._send_to, args=(name, tensors, sequence), daemon=True).start()

    def _send_to(self, name: str, tensors: list[Tensor], sequence: int) -> None:
        """Send ``tensors`` (of weights ``sequence``) to receiver ``name`` over its group (made at its first ask); a
        receiver that leaves meanwhile is let go with a warning."""
        try:
            group = self.groups.get(name) or pair_group(self.manifest({}), TRAINER_RANK, name)
            send_over(group, tensors, self.device)
        except (RuntimeError, OSError) as e:
            with self.changed:
                self.groups.pop(name, None)
            logger.warning(f"weight broadcast: an inference server left while it received weights {sequence} ({e})")
            return
        with self.changed:
            self.groups[name] = group
            if sequence == self.sequence:
                self.takers.add(name)
                self.changed.notify_all()


def send_over(group: dist.ProcessGroup, tensors: list[Tensor], device: torch.device) -> None:
    """Broadcast ``tensors`` in their order over ``group``, each moved to ``device`` first."""
    for tensor in tensors:
        broadcast(group, tensor.detach().to(device).contiguous())
