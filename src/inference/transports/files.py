"""Weights as files: vLLM reads the folder's HF safetensors itself."""

from typing import Any

from inference.transports.base import WeightReceiver


class FileReceiver(WeightReceiver):
    def receive(self, path: str, manifest: dict | None) -> dict[str, Any]:
        return {"weights_path": path}

    def loaded(self, manifest: dict | None) -> None:
        """Nothing to tell: the files stay."""
