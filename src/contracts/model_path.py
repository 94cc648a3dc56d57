"""The tiny test models' names and where their builds live (what a model name loads from is the model card's:
:func:`contracts.model_card.resolve_model_path`).

The tiny models are random models Trident builds locally (no model hub is reachable on CPU machines), named in the
``trident/`` namespace. What every process must agree on lives here: their ids and where a build of each lives. The
builder is a tool (:mod:`tools.tiny_model`, ``uv run --no-sync build-tiny-model [ID]``); ``rl`` and the tests build
the models they name before starting any process, and a process run alone on one not built yet stops with one line
saying how to build it.
"""

import os
from pathlib import Path

TINY_NAMESPACE = "trident/"
TINY_MODEL_ID = "trident/tiny-qwen3"  # the default model: the debug configs and the tests run it on CPU
TINY_MODEL_IDS = (TINY_MODEL_ID, "trident/tiny-qwen2.5", "trident/tiny-llama3", "trident/tiny-qwen3-moe",
                  "trident/tiny-qwen2.5-moe", "trident/tiny-qwen3-vl", "trident/tiny-qwen3-wide")  # fmt: skip
# The builds' version, part of their folder's name: bumped whenever tools.tiny_model or tools.tiny_templates changes
# what they build, so a stale cached build is never reused.
TINY_MODEL_VERSION = 4


def cache_dir() -> Path:
    """Where built models live: ``$TRIDENT_CACHE`` or ``~/.cache/trident``."""
    return Path(os.environ.get("TRIDENT_CACHE", Path.home() / ".cache" / "trident"))


def tiny_model_path(model_id: str = TINY_MODEL_ID) -> Path:
    """The folder of the build of the tiny model ``model_id`` (which may not be built yet)."""
    return cache_dir() / "models" / f"{model_id.split('/')[-1]}-v{TINY_MODEL_VERSION}"


def known_model(name: str) -> str:
    """Validate a model name: a name in the ``trident/`` namespace must be one of the tiny models."""
    if name.startswith(TINY_NAMESPACE) and name not in TINY_MODEL_IDS:
        raise ValueError(f"{name!r} is no model Trident builds; the tiny models are {', '.join(TINY_MODEL_IDS)}")
    return name
