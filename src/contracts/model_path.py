"""Which folder a model name loads from (in transformers and vLLM): a tiny test model's build, made on first use by
:mod:`contracts.tiny_model`, or the name itself (a hub id or a local folder)."""

from contracts.tiny_model import TINY_MODEL_ID, TINY_MODELS, build_tiny_model, tiny_model_path

__all__ = ["TINY_MODEL_ID", "resolve_model_path"]


def resolve_model_path(name: str) -> str:
    """Map a model name to what transformers and vLLM load: a tiny model's built folder, else ``name``."""
    if name in TINY_MODELS:
        return str(build_tiny_model(tiny_model_path(name), name))
    return name
