"""Renderers' memoizing tokenizers give exactly the tokenizer's own ids and text, for each tiny chat family's
tokenizer, and a renderer on one renders, bridges and parses the probe conversation as on a plain tokenizer; a
repeated short encode reaches the tokenizer once."""

import pytest
import renderers.base
from renderers import create_renderer
from transformers import AutoTokenizer

from orchestrator.verifiers_adapter import tokenizer_memo
from orchestrator.verifiers_adapter.patches import install_patches
from orchestrator.verifiers_adapter.renderer import PROBE_MESSAGES, PROBE_TOOLS, renderer_config
from tools.tiny_model import built_model_path

TINY = ["trident/tiny-qwen3", "trident/tiny-qwen2.5", "trident/tiny-llama3"]
TEXTS = ["", "\n", "<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n", "60",
         "Grüße, 世界 ✓", "<tool_response>\n84\n</tool_response>", "x" * tokenizer_memo.MAX_CHARS,
         "a longer tool result, past the memo's limit: " * 4]  # fmt: skip


@pytest.fixture(scope="module", params=TINY)
def path(request) -> str:
    return built_model_path(request.param)


def test_encodes_and_decodes_are_the_tokenizers_own(path):
    plain = AutoTokenizer.from_pretrained(path)
    memo = tokenizer_memo.memoized(AutoTokenizer.from_pretrained(path))
    for _ in range(2):  # the second round comes from the caches
        for text in TEXTS:
            for special in (False, True):
                ids = memo.encode(text, add_special_tokens=special)
                assert ids == plain.encode(text, add_special_tokens=special), (text, special)
                ids.append(-1)  # the caller's own list: the cache is untouched
            assert memo.encode(text) == plain.encode(text)
            ids = plain.encode(text, add_special_tokens=False)
            for n in range(len(ids) + 1):
                for skip in (False, True):
                    expected = plain.decode(ids[:n], skip_special_tokens=skip)
                    assert memo.decode(ids[:n], skip_special_tokens=skip) == expected, (ids[:n], skip)


def test_a_renderer_on_a_memoizing_tokenizer_renders_bridges_and_parses_as_on_a_plain_one(path):
    config = renderer_config("auto", "auto", path, enable_thinking=False)
    results = []
    for tokenizer in (
        AutoTokenizer.from_pretrained(path),
        tokenizer_memo.memoized(AutoTokenizer.from_pretrained(path)),
    ):
        renderer = create_renderer(tokenizer, config)
        results.append([])
        for _ in range(2):
            first = renderer.render_ids(PROBE_MESSAGES[:2], tools=PROBE_TOOLS, add_generation_prompt=True)
            called = renderer.render_ids(PROBE_MESSAGES[:3], tools=PROBE_TOOLS)
            completion = called[len(first) :]  # the assistant's tool call, as sampled
            parsed = renderer.parse_response(completion, tools=PROBE_TOOLS)
            bridged = renderer.bridge_to_next_turn(first, completion, PROBE_MESSAGES[3:4], tools=PROBE_TOOLS)
            whole = renderer.render_ids(PROBE_MESSAGES, tools=PROBE_TOOLS, add_generation_prompt=True)
            assert parsed.tool_calls  # (the "default" renderer of tiny-qwen2.5 does not bridge: None)
            results[-1].append((first, completion, parsed.content, parsed.tool_calls, bridged, whole))
    assert results[0] == results[1]


def test_renderers_tokenizers_are_memoizing_and_reach_the_tokenizer_once_per_short_text(path, monkeypatch):
    calls = []
    original = tokenizer_memo._load_tokenizer

    def counted(model_path):
        tokenizer = original(model_path)
        encode = tokenizer.encode
        tokenizer.encode = lambda text, **kwargs: calls.append(text) or encode(text, **kwargs)
        return tokenizer

    monkeypatch.setattr(tokenizer_memo, "_load_tokenizer", counted)
    monkeypatch.setattr(renderers.base, "load_tokenizer", renderers.base.load_tokenizer)
    install_patches()
    tokenizer = renderers.base.load_tokenizer(path)
    header, long_text = "<|im_start|>assistant\n", TEXTS[-1]
    for _ in range(3):
        tokenizer.encode(header, add_special_tokens=False)
        tokenizer.encode(long_text, add_special_tokens=False)
    assert calls == [header] + [long_text] * 3
