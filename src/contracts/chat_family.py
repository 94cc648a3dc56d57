"""Which chat format a model speaks: the one fact the orchestrator (its renderer) and inference (vLLM's tool-call
parser) must agree on, read from the model's own files."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChatFamily:
    """A chat format: how renderers renders it and how vLLM parses its tool calls."""

    name: str
    renderer: str  # a renderers config name; "default" renders with the model's own chat template
    vllm_tool_call_parser: str  # vLLM's --tool-call-parser


QWEN3 = ChatFamily("qwen3", "qwen3", "hermes")
# renderers has no Qwen2.5 renderer: the model's own template renders it (its tool calls are Hermes', as Qwen3's).
QWEN2_5 = ChatFamily("qwen2.5", "default", "hermes")
LLAMA3 = ChatFamily("llama-3", "llama-3", "llama3_json")
FAMILIES = {family.name: family for family in (QWEN3, QWEN2_5, LLAMA3)}


def detect_family(model_type: str, vocab: set[str] | dict[str, int]) -> ChatFamily | None:
    """The family of a model from its architecture and its tokenizer's tokens; None when none fits."""
    if model_type == "llama" and "<|start_header_id|>" in vocab:
        return LLAMA3
    if "<|im_start|>" in vocab:
        if model_type in ("qwen3", "qwen3_moe"):
            return QWEN3
        if model_type in ("qwen2", "qwen2_moe"):
            return QWEN2_5
    return None


def model_family(path: str) -> ChatFamily | None:
    """:func:`detect_family` for the model at ``path`` (a local folder or a hub id in the local cache)."""
    from transformers import AutoTokenizer

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        model_type = json.loads((folder / "config.json").read_text()).get("model_type", "")
    else:
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(path).model_type
    return detect_family(model_type, AutoTokenizer.from_pretrained(path).get_vocab())
