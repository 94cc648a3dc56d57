"""The chat format follows the model: each tiny model's family is read from its files, its renderer renders exactly
what its chat template does, and a renderer that does not is refused at start, naming both."""

import pytest
from renderers import create_renderer
from renderers.base import load_tokenizer

from contracts.chat_family import model_family
from contracts.errors import TridentError
from inference.config import InferenceModelConfig
from inference.server import tool_call_parser
from orchestrator.config import OrchestratorConfig
from orchestrator.verifiers_adapter.renderer import PROBE_MESSAGES, PROBE_TOOLS, check_renderer, renderer_config
from tools.tiny_model import built_model_path

# tiny model -> (chat family, renderer picked by "auto", vLLM tool-call parser)
EXPECTED = {
    "trident/tiny-qwen3": ("qwen3", "qwen3", "hermes"),
    "trident/tiny-qwen2.5": ("qwen2.5", "default", "hermes"),
    "trident/tiny-llama3": ("llama-3", "llama-3", "llama3_json"),
    "trident/tiny-qwen3-vl": ("qwen3-vl", "qwen3-vl", "hermes"),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def tiny(request) -> tuple[str, str]:
    return request.param, built_model_path(request.param)


def test_auto_picks_the_families_renderer_and_tool_parser_and_they_match_the_template(tiny):
    model_id, path = tiny
    family, renderer, parser = EXPECTED[model_id]
    assert model_family(path).name == family
    config = renderer_config("auto", "auto", path, enable_thinking=False)
    assert config.name == renderer
    assert tool_call_parser(InferenceModelConfig(), path) == parser
    assert (
        tool_call_parser(InferenceModelConfig(tool_call_parser="pythonic"), path) == "pythonic"
    )  # an explicit parser is kept
    check_renderer(config, path)


def test_a_tool_call_reply_in_the_familys_syntax_parses_and_the_next_turn_extends_it(tiny):
    """What the model would sample for a tool call, in its family's own syntax, parses to that call."""
    model_id, path = tiny
    tokenizer = load_tokenizer(path)
    renderer = create_renderer(tokenizer, renderer_config("auto", "auto", path, enable_thinking=False))
    hermes = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call><|im_end|>'
    reply = {
        "qwen3": hermes,
        "qwen2.5": hermes,
        "qwen3-vl": hermes,
        "llama-3": '{"name": "calculator", "parameters": {"expression": "12 * 7"}}<|eot_id|>',
    }[EXPECTED[model_id][0]]
    parsed = renderer.parse_response(tokenizer.encode(reply, add_special_tokens=False), tools=PROBE_TOOLS)
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [("calculator", {"expression": "12 * 7"})]


def test_a_renderer_that_differs_from_the_template_is_refused_naming_both():
    llama, qwen25 = built_model_path("trident/tiny-llama3"), built_model_path("trident/tiny-qwen2.5")
    qwen3 = built_model_path("trident/tiny-qwen3")
    # a renderer for other special tokens: Llama has no ChatML tokens, Qwen2.5 no <think>
    with pytest.raises(TridentError, match=r"renderer 'qwen3' cannot render for .*tiny-llama3.*not found"):
        check_renderer(renderer_config("qwen3", "auto", llama, enable_thinking=False), llama)
    with pytest.raises(TridentError, match=r"renderer 'qwen3' cannot render for .*tiny-qwen2.5.*not found"):
        check_renderer(renderer_config("qwen3", "auto", qwen25, enable_thinking=False), qwen25)
    # same tokens, other text: PrimeIntellect's Qwen3 template has its own system prompt and tool layout
    differs = r"renderer 'prime-qwen3' and the chat template of .*tiny-qwen3.* from token"
    with pytest.raises(TridentError, match=differs):
        check_renderer(renderer_config("prime-qwen3", "auto", qwen3, enable_thinking=False), qwen3)
    # the model's own template always matches itself
    check_renderer(renderer_config("default", "auto", llama, enable_thinking=False), llama)


def test_thinking_needs_a_renderer_with_a_thinking_mode():
    llama = built_model_path("trident/tiny-llama3")
    with pytest.raises(TridentError, match="enable_thinking = true: renderer 'llama-3' has no thinking mode"):
        renderer_config("auto", "auto", llama, enable_thinking=True)
    qwen3 = built_model_path("trident/tiny-qwen3")
    assert renderer_config("auto", "auto", qwen3, enable_thinking=True).enable_thinking is True


def test_an_unknown_renderer_is_a_config_error_naming_the_key():
    with pytest.raises(ValueError, match=r"model.renderer\n.*unknown renderer 'qwen9'"):
        OrchestratorConfig(model={"renderer": "qwen9"})


def test_the_probe_covers_every_kind_of_turn():
    assert {m["role"] for m in PROBE_MESSAGES} == {"system", "user", "assistant", "tool"}
    assert any(m.get("tool_calls") for m in PROBE_MESSAGES)


def test_the_tiny_vlms_image_runs_are_its_processors_tokens_and_its_template_writes_one_placeholder_each():
    """The renderer expands an image to image_grid_thw.prod() / merge² <|image_pad|> tokens (what the server and the
    trainer derive from the model folder's processor); the chat template writes one placeholder per image part."""
    import base64
    import io

    from PIL import Image
    from transformers import AutoProcessor

    path = built_model_path("trident/tiny-qwen3-vl")
    tokenizer = load_tokenizer(path)
    image = Image.new("RGB", (64, 96), "red")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What colour?"}]
    messages = [{"role": "user", "content": content}]
    rendered = create_renderer(tokenizer, renderer_config("auto", "auto", path, False)).render_ids(
        messages, add_generation_prompt=True
    )
    grid = AutoProcessor.from_pretrained(path).image_processor(images=[image])["image_grid_thw"]
    assert grid.tolist() == [[1, 6, 4]]  # 96 × 64 pixels in 16-pixel patches
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert rendered.count(pad) == 6 and 6 == int(grid.prod()) // 4
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert templated.count("<|vision_start|><|image_pad|><|vision_end|>What colour?") == 1
