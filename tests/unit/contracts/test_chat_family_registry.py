"""The chat-family registry: one entry per family decides the renderer, the server's tool-call parser, the checker's
turns and the tiny tokenizer's tokens and template; one ``chat_family`` choice reaches both processes."""

import pytest

from contracts.chat_family import FAMILIES, ChatFamily, model_family
from contracts.chat_turns import ChatFormat, segment
from contracts.config import ConfigError, parse_config
from inference.config import InferenceModelConfig
from inference.server import tool_call_parser
from launch.rl_config import RLConfig, resolve_shared
from orchestrator.config import OrchestratorConfig
from orchestrator.verifiers_adapter.renderer import PROBE_MESSAGES, PROBE_TOOLS, check_renderer, renderer_config
from tools.rollout_check import SampleRecord, check_sample
from tools.tiny_model import TINY_MODELS, TinyModel, build_tokenizer, built_model_path

# A made-up format: <|turn|>ROLE<|says|>content<|done|>, tool results in a "tool" turn, no hand-shaped template.
TEST_FAMILY = ChatFamily(
    "test-chat",
    renderer="default",
    vllm_tool_call_parser="pythonic",
    model_types=("mistral",),
    turn_start="<|turn|>",
    role_end="<|says|>",
    turn_end="<|done|>",
    end_of_text="<|eof|>",
    special_tokens=("<|eof|>", "<|turn|>", "<|says|>", "<|done|>"),
)
# The probe's turns: the tools' system turn, then its messages, then the generation prompt.
PROBE_ROLES = ["system", "system", "user", "assistant", "tool", "assistant", "user", "assistant"]


@pytest.fixture(scope="module")
def test_family_model(tmp_path_factory) -> str:
    """A folder with the test family's tiny tokenizer and a model config of its model_type (no weights needed)."""
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("test-chat")
    build_tokenizer(TinyModel(TEST_FAMILY)).save_pretrained(folder)
    AutoConfig.for_model(TinyModel(TEST_FAMILY).architecture).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(FAMILIES, TEST_FAMILY.name, TEST_FAMILY)


def render_probe(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(
        PROBE_MESSAGES, tools=PROBE_TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_a_family_added_in_one_entry_reaches_renderer_server_checker_and_tiny_template(registered, test_family_model):
    from transformers import AutoTokenizer

    path = test_family_model
    assert model_family(path) is TEST_FAMILY  # detected from its model_type and turn marker
    # the orchestrator's renderer and the server's parser, both from the entry
    config = renderer_config("auto", "auto", path, enable_thinking=False)
    assert config.name == "default" and config.tool_parser is None
    check_renderer(config, path)
    assert tool_call_parser(InferenceModelConfig(), path) == "pythonic"
    # the tiny tokenizer: the entry's markers as single special tokens, its turn end as eos, a template of them
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|done|>" and tokenizer.pad_token == "<|eof|>"
    assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in TEST_FAMILY.special_tokens)
    ids = render_probe(tokenizer)
    text = tokenizer.decode(ids)
    assert "<|turn|>user<|says|>What is 12 * 7? Use the calculator.<|done|>\n" in text
    assert text.endswith("<|turn|>tool<|says|>84<|done|>\n<|turn|>assistant<|says|>12 * 7 = 84.<|done|>\n"
                         "<|turn|>user<|says|>Thanks! And 84 + 16?<|done|>\n<|turn|>assistant<|says|>")  # fmt: skip
    # the checker splits the rendered conversation at the entry's markers, and checks a mask by them
    chat = ChatFormat.from_tokenizer(tokenizer)
    assert chat.family is TEST_FAMILY
    seg = segment(ids, chat)
    assert [turn.role for turn in seg.turns] == PROBE_ROLES
    reply = tokenizer.encode("84 + 16 = 100.<|done|>", add_special_tokens=False)
    mask, logprobs = [False] * len(ids) + [True] * len(reply), [0.0] * len(ids) + [-0.5] * len(reply)
    record = SampleRecord.from_tokens(0, [*ids, *reply], mask, logprobs)
    assert check_sample(record, chat).problems == []
    tool_result = seg.turns[4].content_start  # "84", the tool's answer
    record.loss_mask[tool_result], record.inference_logprobs[tool_result] = True, -0.5
    assert [p.check for p in check_sample(record, chat).problems] == ["mask_in_tool_turn"]


def test_a_chat_family_choice_reaches_the_renderer_and_the_parser_alike(registered, test_family_model):
    qwen3 = built_model_path("trident/tiny-qwen3")
    assert renderer_config("auto", "llama-3", qwen3, enable_thinking=False).name == "llama-3"
    assert tool_call_parser(InferenceModelConfig(chat_family="llama-3"), qwen3) == "llama3_json"
    # a per-side override still wins on its side alone
    assert renderer_config("default", "llama-3", qwen3, enable_thinking=False).tool_parser is None
    assert tool_call_parser(InferenceModelConfig(chat_family="llama-3", tool_call_parser="hermes"), qwen3) == "hermes"
    # rl gives one value to both processes; two different values are refused
    config = resolve_shared(parse_config(RLConfig, ["--model.chat-family", "test-chat", "--inference.port", "8000"]))
    assert config.orchestrator.model.chat_family == config.inference.model.chat_family == "test-chat"
    config = resolve_shared(
        parse_config(RLConfig, ["--orchestrator.model.chat-family", "qwen2.5", "--inference.port", "8000"])
    )
    assert config.inference.model.chat_family == "qwen2.5"
    argv = ["--orchestrator.model.chat-family", "qwen3", "--inference.model.chat-family", "llama-3"]
    with pytest.raises(ConfigError, match="disagree on model.chat_family"):
        resolve_shared(parse_config(RLConfig, argv))


def test_an_unknown_chat_family_is_a_config_error_naming_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"model.chat_family\n.*unknown chat family 'qwen9'; choose auto, qwen3, "):
        OrchestratorConfig(model={"chat_family": "qwen9"})
    with pytest.raises(ConfigError, match=r"--inference.model.chat-family: .*unknown chat family 'qwen9'"):
        parse_config(RLConfig, ["--inference.model.chat-family", "qwen9"])


@pytest.mark.parametrize("model_id", sorted(TINY_MODELS))
def test_each_familys_markers_split_its_tiny_template_into_the_probes_turns(model_id):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built_model_path(model_id))
    family = TINY_MODELS[model_id].family
    chat = ChatFormat.from_tokenizer(tokenizer)
    assert chat.family is family
    roles = [turn.role for turn in segment(render_probe(tokenizer), chat).turns]
    # Llama 3 puts the tools into the first user turn, ChatML into the system turn: the conversation's turns follow
    assert roles[-6:] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
