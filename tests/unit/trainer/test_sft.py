"""SFT: the assistant-only loss mask, data errors, the step loss, and short runs on the tiny model."""

import re
import sys
from itertools import groupby, islice
from pathlib import Path

import datasets
import pytest
import torch
from dataset_rows import DatasetSpec
from jsonl_files import write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from contracts.config import ConfigError, parse_config
from contracts.metrics import read_metrics
from contracts.run_dir import is_stable, weights_dir
from tools.tiny_model import built_model_path
from trainer.config import SFTConfig, TrainerModelConfig
from trainer.parallel import close_world, init_world
from trainer.sft import accumulate_gradients, step_batches_of, train_sft
from trainer.sft_data import SFTDataError, conversation_samples, load_samples, stream_samples
from trainer.sft_main import main
from trainer.train import build_model

CONVERSATION = [
    {"role": "system", "content": "Answer in digits."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 40 + 2?"},
    {"role": "assistant", "content": "It is 42."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def masked_texts(tokenizer, sample) -> list[str]:
    """The decoded runs of consecutive loss-mask tokens."""
    pairs = zip(sample.token_ids, sample.loss_mask, strict=True)
    return [tokenizer.decode([token for token, _ in run]) for masked, run in groupby(pairs, lambda p: p[1]) if masked]


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    [sample] = conversation_samples(tokenizer, CONVERSATION)
    assert sample.token_ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    # content and end-of-turn token; no system, user, generation prompt, or newline after <|im_end|>
    assert masked_texts(tokenizer, sample) == ["5<|im_end|>", "It is 42.<|im_end|>"]


def test_a_template_that_rewrites_earlier_turns_splits_the_conversation(tokenizer):
    # the tiny model's template (like Qwen3's) drops an assistant turn's thinking once a later user turn follows
    thinking = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<think>\n2 + 3 = 5\n</think>\n\n5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"},
    ]
    first, second = conversation_samples(tokenizer, thinking)
    assert masked_texts(tokenizer, first) == ["<think>\n2 + 3 = 5\n</think>\n\n5<|im_end|>"]
    assert masked_texts(tokenizer, second) == ["8<|im_end|>"]
    assert "<think>" not in tokenizer.decode(second.token_ids)


CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}


@pytest.mark.parametrize("model", ["trident/tiny-qwen3", "trident/tiny-llama3"])
def test_a_row_with_tools_renders_them_and_trains_the_calls(model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(built_model_path(model))
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "#### 5"}]  # fmt: skip
    write_jsonl(tmp_path / "data.jsonl", [{"messages": messages, "tools": [CALCULATOR]}])
    [sample] = load_samples(DatasetSpec(path=str(tmp_path / "data.jsonl")), tokenizer, seq_len=1024)
    assert sample.token_ids == tokenizer.apply_chat_template(messages, tools=[CALCULATOR], return_dict=False)
    prompt = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if not m])
    assert '"name": "calculator"' in prompt and "Evaluate arithmetic." in prompt  # the declaration, untrained
    end = tokenizer.eos_token
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    if model == "trident/tiny-llama3":
        call = '{"name": "calculator", "parameters": {"expression": "2 + 3"}}'
    assert masked_texts(tokenizer, sample) == [call + end, "#### 5" + end]


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"text": "no messages"}, '"messages"'),
        ('{"messages": [', "invalid JSON"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hi"}]}, "messages\\[1\\]"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": CONVERSATION, "tools": "calculator"}, "tools: expected a list"),
    ],
)
def test_a_bad_row_is_an_error_naming_file_and_line(tokenizer, tmp_path, bad_row, message):
    write_jsonl(tmp_path / "data.jsonl", [{"messages": CONVERSATION}, bad_row])
    with pytest.raises(SFTDataError, match=f"^{re.escape(str(tmp_path / 'data.jsonl'))}:2: .*{message}"):
        load_samples(DatasetSpec(path=str(tmp_path / "data.jsonl")), tokenizer, seq_len=512)


ARITHMETIC = [
    [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
    for a, b in [(2, 3), (10, 7), (31, 4), (8, 8), (1, 1), (6, 0)]
]


def write_parquet(path, rows: list[dict]) -> str:
    datasets.Dataset.from_list(rows).to_parquet(path)
    return str(path)


def test_parquet_with_a_mapped_column_gives_the_jsonl_samples_loaded_or_streamed(tokenizer, tmp_path):
    from_jsonl = load_samples(
        DatasetSpec(path=write_jsonl(tmp_path / "data.jsonl", [{"messages": m} for m in ARITHMETIC])), tokenizer, 512
    )
    path = write_parquet(tmp_path / "data.parquet", [{"id": i, "chat": m} for i, m in enumerate(ARITHMETIC)])
    loaded = load_samples(DatasetSpec(path=path, columns={"messages": "chat"}), tokenizer, 512)
    spec = DatasetSpec(path=path, columns={"messages": "chat"}, streaming=True)
    streamed = list(islice(stream_samples(spec, tokenizer, 512, seed=None), 2 * len(ARITHMETIC)))  # two passes
    assert [s.token_ids for s in from_jsonl] == [s.token_ids for s in loaded] == [s.token_ids for s in streamed[:6]]
    assert [s.loss_mask for s in from_jsonl] == [s.loss_mask for s in streamed[6:]]
    assert [masked_texts(tokenizer, s) for s in loaded][:2] == [["5<|im_end|>"], ["17<|im_end|>"]]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_bad_row_of_a_parquet_file_is_named(tokenizer, tmp_path, streaming):
    messages = [ARITHMETIC[0], [{"role": "user", "content": "hi"}]]
    spec = DatasetSpec(path=write_parquet(tmp_path / "data.parquet", [{"messages": m} for m in messages]))
    samples = stream_samples(spec, tokenizer, 512, seed=None) if streaming else None
    with pytest.raises(SFTDataError, match=rf"^{re.escape(spec.path)}:2: no assistant message"):
        list(samples) if streaming else load_samples(spec, tokenizer, 512)


def test_streamed_steps_pass_over_the_data_in_a_seeded_order_each_pass(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "data.parquet", [{"messages": m} for m in ARITHMETIC])
    data = {"path": path, "streaming": True, "batch_size": 4, "shuffle_buffer": 6}
    config = SFTConfig(data=data, max_steps=3, output_dir=tmp_path, seed=7)
    batches, num_steps = step_batches_of(config, tokenizer)
    answers = [[tokenizer.decode(s.token_ids).split("assistant\n")[-1].split("<")[0] for s in b] for b in batches]
    assert num_steps == 3 and [len(batch) for batch in answers] == [4, 4, 4]
    order = sum(answers, [])  # 12 samples: two passes over the 6 conversations, each in its own order
    assert sorted(order[:6]) == sorted(order[6:]) == sorted(["5", "17", "35", "16", "2", "6"])
    assert order[:6] != order[6:]
    assert [[s.token_ids for s in batch] for batch in step_batches_of(config, tokenizer)[0]] == [
        [s.token_ids for s in batch] for batch in step_batches_of(config, tokenizer)[0]
    ]  # seeded


def test_streaming_needs_max_steps(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.streaming = true needs max_steps"):
        parse_config(SFTConfig, ["--data.path", "data.parquet", "--data.streaming", "true"])


@pytest.mark.parametrize("bad_row", [{"text": "no messages"}, '{"messages": ['])
def test_sft_exits_with_one_error_line_on_bad_data(tiny_model_path, tmp_path, monkeypatch, capsys, bad_row):
    write_jsonl(tmp_path / "data.jsonl", [{"messages": CONVERSATION}, bad_row])
    argv = ["sft", "--data.path", str(tmp_path / "data.jsonl"), "--model.name", tiny_model_path]
    monkeypatch.setattr(sys, "argv", [*argv, "--output-dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "ERROR sft failed: " in line and f"{tmp_path / 'data.jsonl'}:2: " in line


def test_a_tokenizer_without_chat_template_is_an_error(tokenizer, tmp_path):
    write_jsonl(tmp_path / "data.jsonl", [{"messages": CONVERSATION}])
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    with pytest.raises(SFTDataError, match="no chat template"):
        load_samples(DatasetSpec(path=str(tmp_path / "data.jsonl")), plain, seq_len=512)


def test_samples_longer_than_seq_len_are_dropped(tokenizer, tmp_path):
    long = [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "1"}]
    write_jsonl(tmp_path / "data.jsonl", [{"messages": CONVERSATION}, {"messages": long}])
    [sample] = load_samples(DatasetSpec(path=str(tmp_path / "data.jsonl")), tokenizer, seq_len=64)
    assert len(sample.token_ids) <= 64
    with pytest.raises(SFTDataError, match="no sample fits"):
        load_samples(DatasetSpec(path=str(tmp_path / "data.jsonl")), tokenizer, seq_len=16)


def test_the_step_loss_and_gradients_do_not_depend_on_the_micro_batch_split(tiny_model_path, tokenizer):
    other = [{"role": "user", "content": "How much is 7 times 6?"}, {"role": "assistant", "content": "42"}]
    samples = conversation_samples(tokenizer, CONVERSATION) + conversation_samples(tokenizer, other)
    world = init_world()  # a one-rank process group, as the trainer runs alone
    try:
        model = build_model(TrainerModelConfig(name=tiny_model_path), world, offload=False)
        results = []
        for seq_len in (512, max(len(s.token_ids) for s in samples)):  # one micro-batch, then one per sample
            model.zero_grad(set_to_none=True)
            loss = accumulate_gradients(model, samples, seq_len, world)
            results.append((loss, {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    finally:
        close_world()
    (one_loss, one_grads), (split_loss, split_grads) = results
    assert one_loss == pytest.approx(split_loss, rel=1e-5)
    for name, grad in one_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-6, rtol=1e-4)


def tiny_run_config(tmp_path, model: dict, max_steps: int, **overrides) -> SFTConfig:
    """Four one-turn conversations, all in each step."""
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]}
        for a, b in [(2, 3), (10, 7), (31, 4), (8, 8)]
    ]
    data = {"path": write_jsonl(tmp_path / "data.jsonl", rows), "batch_size": 4}
    return SFTConfig(
        model=model, data=data, output_dir=tmp_path, max_steps=max_steps, seq_len=128, optim={"lr": 1e-2}, **overrides
    )


def test_sft_memorizes_a_tiny_dataset_and_writes_weights(tiny_model_path, tmp_path):
    train_sft(tiny_run_config(tmp_path, {"name": tiny_model_path}, max_steps=6, save_every=3))
    records = read_metrics(tmp_path, "sft")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"] / 2
    assert is_stable(weights_dir(tmp_path, 3)) and is_stable(weights_dir(tmp_path, 6))


def test_lora_sft_trains_only_the_adapter(tiny_model_path, tmp_path):
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    train_sft(tiny_run_config(tmp_path, {"name": tiny_model_path, "experimental": {"lora": lora}}, max_steps=2))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(weights_dir(tmp_path, 2), dtype=torch.float32).state_dict()
    changed = {name for name in base if not torch.equal(base[name], tuned[name])}
    assert changed and all(".q_proj." in name or ".v_proj." in name for name in changed)


def test_the_debug_configs_and_their_data_load(tokenizer, monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[3])  # config paths start at the repository root
    config = parse_config(SFTConfig, ["@", "configs/debug/sft/sft.toml"])
    samples = load_samples(config.data, tokenizer, config.seq_len)
    assert len(samples) == len(Path(config.data.path).read_text().splitlines())
    assert all(any(sample.loss_mask) for sample in samples)
    streaming = parse_config(SFTConfig, ["@", "configs/debug/sft/streaming.toml"])
    assert streaming.data.path == config.data.path and streaming.data.streaming
    one_pass = list(islice(stream_samples(streaming.data, tokenizer, streaming.seq_len, seed=0), len(samples)))
    assert sorted(s.token_ids for s in one_pass) == sorted(s.token_ids for s in samples)
    assert [s.token_ids for s in one_pass] != [s.token_ids for s in samples]  # shuffled
