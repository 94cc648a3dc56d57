"""The renderer that turns conversations into the token ids the server samples from: chosen from the model, and
checked against the model's own chat template before any rollout."""

import copy
import json

from renderers import DefaultRendererConfig, create_renderer
from renderers.base import MODEL_RENDERER_MAP, load_tokenizer
from renderers.configs import BaseRendererConfig, config_from_name

from contracts.chat_family import AUTO, ChatFamily, resolve_family
from contracts.errors import TridentError

PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
# A tool turn and its result, a reply, and a user speaking again: every kind of turn a rollout renders.
PROBE_MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 12 * 7? Use the calculator."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "84"},
    {"role": "assistant", "content": "12 * 7 = 84."},
    {"role": "user", "content": "Thanks! And 84 + 16?"},
]


def renderer_config(renderer: str, chat_family: str, model_path: str, enable_thinking: bool) -> BaseRendererConfig:
    """The renderers config for ``[model] renderer`` and ``chat_family``, with ``enable_thinking`` applied.

    ``renderer`` "auto": with ``chat_family`` "auto", renderers' own map of hub ids first; then the renderer of the
    chat family ``chat_family`` selects (:func:`~contracts.chat_family.resolve_family`); then "default", the model's
    own template."""
    name = renderer
    if name == "auto" and chat_family == AUTO:
        name = MODEL_RENDERER_MAP.get(model_path, "auto")
    family = resolve_family(chat_family, model_path) if name in ("auto", "default") else None
    if name == "auto":
        name = family.renderer if family else "default"
    if name == "default":  # the model's own template, and the family's tool parser
        config = DefaultRendererConfig(tool_parser=default_tool_parser(family, model_path))
    else:
        config = config_from_name(name)
    if "enable_thinking" in type(config).model_fields:
        return config.model_copy(update={"enable_thinking": enable_thinking})
    if enable_thinking:
        raise TridentError(f"sampling.enable_thinking = true: renderer {name!r} has no thinking mode")
    return config


def default_tool_parser(family: ChatFamily | None, model_path: str) -> str | None:
    """The tool parser of the "default" renderer: the family's, else Hermes' (renderers' "qwen3":
    <tool_call>{json}</tool_call>) for a tokenizer that has <tool_call>, else none."""
    if family is not None:
        return family.renderer_tool_parser
    return "qwen3" if "<tool_call>" in load_tokenizer(model_path).get_vocab() else None


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_renderer(config: BaseRendererConfig, model_path: str) -> None:
    """Raise unless the renderer renders the probe conversation to the same ids as the model's chat template.

    The opening prompt (no system message: templates differ in their default one) is compared under ``config``; the
    whole conversation under the template-faithful variant
    (renderers keep an empty thinking block in history when thinking is off, on purpose: tokens stay stable).
    """
    tokenizer = load_tokenizer(model_path)
    faithful = config
    if getattr(config, "enable_thinking", True) is False:
        faithful = config.model_copy(update={"enable_thinking": True})
    for cfg, messages in ((config, PROBE_MESSAGES[1:2]), (faithful, PROBE_MESSAGES)):
        try:
            rendered = create_renderer(tokenizer, cfg).render_ids(
                messages, tools=PROBE_TOOLS, add_generation_prompt=True
            )
        except Exception as e:  # e.g. the renderer's special tokens are not in this tokenizer
            raise TridentError(
                f"renderer {cfg.name!r} cannot render for {model_path}: {type(e).__name__}: {e}"
            ) from None
        template_messages = copy.deepcopy(messages)
        for message in template_messages:  # templates get arguments as objects, as vLLM passes them
            for call in message.get("tool_calls", []):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        kwargs = {field: getattr(cfg, field) for field in type(cfg).template_field_names()}
        expected = tokenizer.apply_chat_template(
            template_messages, tools=PROBE_TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        if rendered != expected:
            i = _first_difference(rendered, expected)
            raise TridentError(
                f"renderer {cfg.name!r} and the chat template of {model_path} render a probe conversation "
                f"differently from token {i}: renderer {tokenizer.decode(rendered[i : i + 24])!r}, template "
                f"{tokenizer.decode(expected[i : i + 24])!r}; set [model] renderer in orch.toml to one that matches "
                '("default" renders with the model\'s own template)'
            )
