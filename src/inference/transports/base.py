"""A server worker's end of a weight transport, one receiver per way the trainer's weights arrive: files in their
weights folder (:mod:`.files`), or, when the folder holds a manifest (:mod:`contracts.weight_manifest`), from the
trainer's memory over a process group (:mod:`.process_group`) or a shared buffer (:mod:`.shared_buffer`). Loaded
into vLLM's worker process (``inference.worker``): keep the imports to torch, the standard library and contracts."""

from abc import ABC, abstractmethod
from typing import Any


class WeightReceiver(ABC):
    """How the worker gets the weights of one folder: :meth:`receive` before vLLM loads them in place,
    :meth:`loaded` after."""

    @abstractmethod
    def receive(self, path: str, manifest: dict | None) -> dict[str, Any] | None:
        """What vLLM's ``reload_weights`` loads the weights of the folder ``path`` from, as its keyword arguments
        (``weights_path`` or ``weights_iterator``); None when the trainer no longer holds them (it has sent newer
        weights since)."""

    @abstractmethod
    def loaded(self, manifest: dict | None) -> None:
        """Once the weights are in the worker's model."""

    def forget(self) -> None:  # noqa: B027 (a receiver that keeps no copy has nothing to drop)
        """The model's weights came another way: drop what the receiver keeps of the weights it loaded, if anything."""

    def served_checksum(self) -> str | None:
        """The checksum of the weights loaded last (``contracts.weight_delta.weights_checksum``), where the receiver
        keeps a copy of them; None otherwise."""
        return None
