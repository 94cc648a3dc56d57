"""Which folder a model name loads from (in transformers and vLLM): a tiny test model's build in the cache, or the
name itself (a hub id or a local folder).

The tiny models are random models Trident builds locally (no model hub is reachable on CPU machines), named in the
``trident/`` namespace. What every process must agree on lives here: their ids and where a build of each lives. The
builder is a tool (:mod:`tools.tiny_model`, ``uv run --no-sync build-tiny-model [ID]``); ``rl`` and the tests build
the models they name before starting any process, and a process run alone on one not built yet stops with one line
saying how to build it.
"""

import json
import os
from pathlib import Path

from contracts.errors import TridentError

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


def resolve_model_path(name: str) -> str:
    """Map a model name to what transformers and vLLM load: a tiny model's built folder, else ``name``.

    Raises a TridentError for a ``trident/`` name that is no tiny model, or for a tiny model not built yet."""
    try:
        known_model(name)
    except ValueError as e:
        raise TridentError(f"model {e}") from None
    if name not in TINY_MODEL_IDS:
        return name
    path = tiny_model_path(name)
    if not (path / "config.json").is_file():
        raise TridentError(f"model {name!r} is not built yet: run `uv run --no-sync build-tiny-model {name}` "
                           "(rl builds it before it starts the processes)")  # fmt: skip
    return str(path)


# The key of a config.json that counts a mixture of experts' routed experts, by family: Qwen2-MoE's and the hub's
# Qwen3-MoE files; Mixtral, gpt-oss and transformers 5's own Qwen3-MoE files; DeepSeek-V2/V3 and GLM-4.5.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def routed_experts(config: dict) -> int:
    """How many routed experts each sparse layer of the model of ``config`` (a config.json's fields; a multimodal
    model's are its text model's) has: 0 for a dense model."""
    config = config.get("text_config", config)
    return next((config[key] for key in EXPERT_KEYS if config.get(key)), 0)


def folder_config(folder: str | None) -> dict:
    """The fields of the config.json in ``folder``; empty where there is none to read (None: not on this machine)."""
    config_file = Path(folder or "").expanduser() / "config.json"
    if folder is None or not config_file.is_file():
        return {}
    return json.loads(config_file.read_text())


def is_mixture_of_experts(folder: str | None) -> bool:
    """Whether the model in ``folder`` routes each token to some of its experts (its config.json, or its text
    model's, counts routed experts); False where there is no config.json to read."""
    return routed_experts(folder_config(folder)) > 0


def is_vision_language(folder: str | None) -> bool:
    """Whether the model in ``folder`` takes images (its config.json has a ``vision_config``: Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL and most others); False where there is no config.json to read."""
    return "vision_config" in folder_config(folder)


# A vision-language model's marker tokens, by their config.json keys (the Qwen-VL families'): placeholders and fences.
VISION_MARKER_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_markers(folder: str | None) -> dict[int, str]:
    """The image and video marker tokens of the vision-language model in ``folder`` (id: text), which only a prompt
    may hold: the orchestrator bans them from sampling (a sampled placeholder would read as an image). Empty for a
    text model; the texts come from its tokenizer.json."""
    config = folder_config(folder)
    ids = {config[key] for key in VISION_MARKER_KEYS if isinstance(config.get(key), int)}
    if "vision_config" not in config or not ids:
        return {}
    added = json.loads((Path(folder).expanduser() / "tokenizer.json").read_text()).get("added_tokens", [])
    return {token["id"]: token["content"] for token in added if token["id"] in ids}
