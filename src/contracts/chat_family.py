"""The chat families Trident knows, one registry entry each: everything the processes and tools must agree on about
a chat format. The orchestrator renders with the entry's renderer, the inference server parses tool calls with its
vLLM parser, the rollout checker cuts samples into turns at its markers, and the tiny test models (a tool,
:mod:`tools.tiny_model`) take their tokenizer's tokens from it. A new family is one more entry in :data:`FAMILIES`.

Which family a run speaks is chosen once (``[model] chat_family``, "auto": read from the model's files) and looked
up here by name on both sides (:func:`resolve_family`).
"""

from dataclasses import dataclass
from pathlib import Path

from contracts.model_card import ModelCard


@dataclass(frozen=True)
class ChatFamily:
    """A chat format: how it is detected, rendered, served, and split into turns."""

    name: str
    renderer: str  # a renderers config name; "default" renders with the model's own chat template
    vllm_tool_call_parser: str  # vLLM's --tool-call-parser
    model_types: tuple[str, ...]  # transformers model_type of its models (the first builds its tiny model)
    # Turns: TURN_START role ROLE_END content TURN_END, then whitespace up to the next turn. Markers are token texts.
    turn_start: str  # opens a turn (its presence in a vocabulary, with the model_type, detects the family)
    role_end: str  # closes the header after the role's name
    turn_end: str  # closes a turn; the end-of-sequence token of its models
    end_of_text: str  # ends a document; a reply may stop on it too (the server may add turn_end after it)
    special_tokens: tuple[str, ...]  # single ids that decode(skip_special_tokens=True) drops, markers included
    added_tokens: tuple[str, ...] = ()  # single ids that detokenization keeps (tool-call tags vLLM's parser reads)
    other_stops: tuple[str, ...] = ()  # further tokens a reply may stop on
    bos_token: str | None = None  # prepended by plain encodes when set
    tool_roles: tuple[str, ...] = ("tool",)  # roles of turns that hold tool results
    tool_response: str | None = None  # a user turn opening with this holds tool results (Hermes)
    scaffold: str = ""  # text a reply's turn may open with that the model did not sample (an empty think block)
    renderer_tool_parser: str | None = None  # renderers' parser of its tool calls, for renderer "default"
    image_pad: str | None = None  # a vision-language family's image placeholder: N per image (contracts.images)


_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_HERMES = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# ChatML: <|im_start|>ROLE\n ... <|im_end|>\n; Hermes tool calls, results in a user turn opening with <tool_response>.
_QWEN = {
    "turn_start": "<|im_start|>",
    "role_end": "\n",
    "turn_end": "<|im_end|>",
    "end_of_text": "<|endoftext|>",
    "special_tokens": _QWEN_SPECIAL,
    "tool_response": "<tool_response>",
    "renderer_tool_parser": "qwen3",  # renderers' parser of Hermes tool calls
}
QWEN3 = ChatFamily("qwen3", "qwen3", "hermes", ("qwen3", "qwen3_moe"), **_QWEN,
                   added_tokens=("<think>", "</think>", *_HERMES), scaffold="<think>\n\n</think>\n\n")  # fmt: skip
# renderers has no Qwen2.5 renderer: the model's own template renders it (its tool calls are Hermes', as Qwen3's).
QWEN2_5 = ChatFamily("qwen2.5", "default", "hermes", ("qwen2", "qwen2_moe"), **_QWEN, added_tokens=_HERMES)
# Qwen3-VL Instruct: ChatML without thinking, images as <|vision_start|><|image_pad|>…<|vision_end|> runs.
QWEN3_VL = ChatFamily("qwen3-vl", "qwen3-vl", "hermes", ("qwen3_vl", "qwen3_vl_moe"), **{**_QWEN, "special_tokens": (
    *_QWEN_SPECIAL, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")},
    added_tokens=("<think>", "</think>", *_HERMES), image_pad="<|image_pad|>")  # fmt: skip
# Llama 3.x: <|start_header_id|>ROLE<|end_header_id|>\n\n ... <|eot_id|>, tool results in an ipython turn.
LLAMA3 = ChatFamily(
    "llama-3", "llama-3", "llama3_json", ("llama",),
    turn_start="<|start_header_id|>", role_end="<|end_header_id|>\n\n", turn_end="<|eot_id|>",
    end_of_text="<|end_of_text|>", other_stops=("<|eom_id|>",), bos_token="<|begin_of_text|>",
    special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|eom_id|>", "<|python_tag|>"),
    tool_roles=("ipython", "tool"),
)  # fmt: skip
FAMILIES = {family.name: family for family in (QWEN3, QWEN2_5, QWEN3_VL, LLAMA3)}
AUTO = "auto"


def detect_family(model_type: str, vocab: set[str] | dict[str, int]) -> ChatFamily | None:
    """The family of a model from its architecture and its tokenizer's tokens; None when none fits."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types and f.turn_start in vocab), None)


def family_by_markers(vocab: set[str] | dict[str, int]) -> ChatFamily | None:
    """The first family whose turn markers the vocabulary has, whatever the model (e.g. for a tokenizer alone)."""
    return next((f for f in FAMILIES.values() if f.turn_start in vocab and f.turn_end in vocab), None)


def local_model_type(path: str) -> str | None:
    """The model_type of the model in folder ``path`` (its card's); None when ``path`` is no local model folder."""
    return ModelCard.of(path).model_type if Path(path).expanduser().is_dir() else None


def model_vocab(path: str) -> dict[str, int]:
    """The vocabulary of the model at ``path``, added tokens included: read from its ``tokenizer.json`` by
    tokenizers when it is a local folder that has one (transformers takes seconds to import: ``rl`` starts
    faster), else through transformers' tokenizer."""
    file = Path(path).expanduser() / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).get_vocab()


def model_family(path: str) -> ChatFamily | None:
    """:func:`detect_family` for the model at ``path`` (a local folder or a hub id in the local cache)."""
    return detect_family(ModelCard.of(path).hub().model_type, model_vocab(path))


def resolve_family(choice: str, model_path: str) -> ChatFamily | None:
    """The family a ``[model] chat_family`` value selects: the named entry, or for "auto" the model's own
    (:func:`model_family`; None when no entry fits it)."""
    return model_family(model_path) if choice == AUTO else FAMILIES[choice]


def known_family(choice: str) -> str:
    """Validate a ``[model] chat_family`` value: "auto" or the name of an entry of :data:`FAMILIES`."""
    if choice != AUTO and choice not in FAMILIES:
        raise ValueError(f"unknown chat family {choice!r}; choose {AUTO}, {', '.join(FAMILIES)}")
    return choice
