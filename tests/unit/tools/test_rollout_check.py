"""The rollout checker on realistic batches: token-in/token-out samples built with the tiny model's chat template,
masks exactly on what the model sampled; then one planted fault per check."""

import functools
import json
import logging
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from rollouts import rollout
from script_modules import load_script
from transformers import AutoTokenizer

from contracts.chat_family import QWEN2_5, QWEN3
from contracts.chat_turns import ChatFormat, segment
from contracts.protocol import BatchInfo, MicroBatch, Sample, sample_summary, write_batch
from contracts.sampling import Truncation
from orchestrator.batching.echo import echo_weights
from orchestrator.metrics.failed_rollouts import write_failed_rollouts
from tools.rollout_check import check_step, open_step, read_step

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": []},
        },
    }
]
SYSTEM = "You are a careful assistant."
QUESTION = "What is 6 * 7?"
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}
TOOL_RESULT = "42"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatFormat.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def check_loss_mask():
    return load_script("check_loss_mask")


class Builder:
    """A sample as the server makes it: rendered prompts, then the sampled completion's ids (trained)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.mask: list[bool] = []
        self.spans: dict[str, tuple[int, int]] = {}

    def add(self, name: str, text: str, sampled: bool) -> None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.spans[name] = (len(self.ids), len(self.ids) + len(ids))
        self.ids += ids
        self.mask += [sampled] * len(ids)

    def sample(self, reward: float, **meta) -> Sample:
        logprobs = [-0.25 if m else 0.0 for m in self.mask]
        return Sample(self.ids, self.mask, logprobs, advantage=0.0, reward=reward, weight_step=2, meta=meta)


def render(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=False
    )


def tool_sample(tokenizer, truncated: bool = False) -> tuple[Sample, Builder]:
    """system + tools, user, assistant calling a tool, tool result, assistant answer (the orchestrator's path:
    each new prompt extends the previous prompt + completion)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    b = Builder(tokenizer)
    b.add("prompt", render(tokenizer, messages, True), sampled=False)
    b.add(
        "call",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call><|im_end|>',
        True,
    )
    history = render(tokenizer, [*messages, {"role": "assistant", "content": "", "tool_calls": [CALL]}], False)
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": TOOL_RESULT},
    ]
    follow_up = render(tokenizer, messages, True)
    assert follow_up.startswith(history) and history.endswith("<|im_end|>\n")
    b.add("tool_turn", "\n" + follow_up[len(history) :], sampled=False)
    b.add("answer", "Six times seven is 42." if truncated else "The answer is 42.<|im_end|>", sampled=True)
    rewards = {"correct_answer": 0.0 if truncated else 1.0, "format": 1.0}
    sample = b.sample(reward=sum(rewards.values()) / 2, env="gsm8k-calc", task=7, rewards=rewards,
                      truncated=truncated, turns=2)  # fmt: skip
    return sample, b


def chat_sample(tokenizer) -> tuple[Sample, Builder]:
    b = Builder(tokenizer)
    messages = [{"role": "user", "content": "Reverse the text: one two three"}]
    b.add("prompt", tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=False), sampled=False)  # fmt: skip
    b.add("answer", "three two one<|im_end|>", sampled=True)
    return b.sample(reward=0.5, env="reverse-text", task=3, rewards={"lcs": 0.5}, truncated=False, turns=1), b


def write_step(output_dir: Path, samples: list[Sample], model: str, step: int = 0, mutate=None) -> Path:
    """Write ``rollouts/step_N`` (the first sample alone in micro_batch_0, the rest in micro_batch_1) and the
    run's config, as the orchestrator does (which writes no empty micro-batch)."""
    bins = [b for b in (samples[:1], samples[1:]) if b]
    packed = [s for b in bins for s in b]
    micro_batches = [MicroBatch.pack(b) for b in bins]
    info = BatchInfo(
        step=step,
        num_samples=len(packed),
        num_tokens=sum(len(s.token_ids) for s in packed),
        num_loss_tokens=sum(sum(s.loss_mask) for s in packed),
        num_ce_tokens=sum(m.ce_tokens() for m in micro_batches),
        reward_mean=sum(s.reward for s in packed) / len(packed),
        temperature=1.0,
        weight_steps=[2],
        samples=[sample_summary(s) for s in packed],
    )
    if mutate:
        mutate(info, micro_batches)
    (output_dir / "configs").mkdir(parents=True, exist_ok=True)
    (output_dir / "configs" / "orchestrator.toml").write_text(f'[model]\nname = "{model}"\n')
    return write_batch(output_dir, info, micro_batches)


@pytest.fixture(scope="module")
def samples(tokenizer):
    (tool, tool_b), (truncated, _), (short, _) = (
        tool_sample(tokenizer),
        tool_sample(tokenizer, truncated=True),
        chat_sample(tokenizer),
    )
    return {"tool": tool, "tool_builder": tool_b, "truncated": truncated, "short": short}


def baseline(samples) -> list[Sample]:
    return [replace(samples["tool"]), replace(samples["truncated"]), replace(samples["short"])]


def checks_found(output_dir: Path, chat) -> dict[str, list]:
    report = check_step(read_step(output_dir), chat)
    found: dict[str, list] = {}
    for problem in report.all_problems():
        found.setdefault(problem.check, []).append(problem)
    return found


# ── clean batches ───────────────────────────────────────────────────────────────────────────────────────


def test_segmentation_finds_roles_and_template_parts(samples, chat, tokenizer):
    sample, b = samples["tool"], samples["tool_builder"]
    seg = segment(sample.token_ids, chat)
    assert [t.role for t in seg.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert all(t.closed for t in seg.turns)
    # The loss mask the builder set is exactly the assistant content (scaffold and header excluded).
    trainable_parts = {(seg.roles[i], seg.parts[i]) for i, m in enumerate(sample.loss_mask) if m}
    assert trainable_parts == {("assistant", "content"), ("assistant", "end")}
    first_reply = seg.turns[2]
    assert seg.parts[first_reply.start] == "header"
    scaffold = [tokenizer.decode([sample.token_ids[i]]) for i, p in enumerate(seg.parts) if p == "scaffold"]
    assert "".join(scaffold) == "<think>\n\n</think>\n\n" * 2
    newline_after_call = b.spans["tool_turn"][0]
    assert seg.parts[newline_after_call] == "separator" and seg.roles[newline_after_call] == "assistant"


def test_clean_batch_passes(tmp_path, samples, chat, tiny_model_path, check_loss_mask, capsys):
    write_step(tmp_path, baseline(samples), tiny_model_path, step=3)
    rollouts = read_step(tmp_path)
    assert rollouts.step == 3 and len(rollouts.samples) == 3
    assert [s.micro_batch for s in rollouts.samples] == [0, 1, 1]
    assert rollouts.samples[0].summary["env"] == "gsm8k-calc"
    assert rollouts.samples[0].token_ids == samples["tool"].token_ids
    report = check_step(rollouts, chat)
    assert report.ok and report.num_warnings == 0, report.all_problems()

    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "loss masks OK" in out and "step 3" in out


def test_json_output_carries_counts(tmp_path, samples, tiny_model_path, check_loss_mask, capsys):
    write_step(tmp_path, baseline(samples), tiny_model_path)
    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tool = samples["tool"]
    assert doc["ok"] and doc["samples"] == 3 and doc["errors"] == 0
    assert doc["trainable"] == sum(sum(s.loss_mask) for s in baseline(samples))
    first = doc["sample_reports"][0]
    assert first["trainable"] == sum(tool.loss_mask) and first["tokens"] == len(tool.token_ids)
    assert first["by_role"]["assistant"]["trainable"] == sum(tool.loss_mask)
    assert first["by_role"]["tool"]["trainable"] == 0 and first["by_role"]["tool"]["tokens"] > 0
    assert [t["role"] for t in first["turns"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert sum(t["trainable"] for t in first["turns"]) == sum(tool.loss_mask)
    assert first["summary"]["rewards"] == {"correct_answer": 1.0, "format": 1.0}


def test_the_checker_counts_each_seats_samples_and_trainable_tokens(tmp_path, samples, tiny_model_path,
                                                                    check_loss_mask, capsys):  # fmt: skip
    seated = [replace(s, meta={**s.meta, "seat": seat}) for s, seat in
              zip(baseline(samples), ["player0", "player1", "player0"], strict=True)]  # fmt: skip
    write_step(tmp_path, seated, tiny_model_path)
    trainable = [sum(s.loss_mask) for s in seated]
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip()
    assert f"(player0: 2 samples, {trainable[0] + trainable[2]} trainable, player1: 1 samples, {trainable[1]} " in line
    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seats"] == {
        "player0": {"samples": 2, "trainable": trainable[0] + trainable[2]},
        "player1": {"samples": 1, "trainable": trainable[1]},
    }


def test_old_batch_without_sample_records_passes(tmp_path, samples, chat, tiny_model_path):
    write_step(tmp_path, baseline(samples), tiny_model_path, mutate=lambda info, mbs: setattr(info, "samples", []))
    report = check_step(read_step(tmp_path), chat)
    assert report.ok and report.samples[0].record.summary == {}


def test_the_runs_chat_family_gives_the_turn_markers(tmp_path, samples, tiny_model_path):
    write_step(tmp_path, baseline(samples), tiny_model_path)
    assert open_step(tmp_path)[1].family is QWEN3  # "auto": the model's own
    config = tmp_path / "configs" / "orchestrator.toml"
    config.write_text(f'[model]\nname = "{tiny_model_path}"\nchat_family = "qwen2.5"\n')
    assert open_step(tmp_path)[1].family is QWEN2_5  # the run's choice


def test_missing_rollouts_is_one_line_and_exit_2(tmp_path, check_loss_mask, capsys):
    assert check_loss_mask.main(["--output-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "nowhere" / "rollouts") in err
    (tmp_path / "rollouts" / "step_0").mkdir(parents=True)
    (tmp_path / "rollouts" / "step_0" / "batch.json").write_text("{}")
    (tmp_path / "rollouts" / "step_0" / "micro_batch_0.safetensors").write_text("not safetensors")
    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--step", "0"]) == 2
    assert "micro_batch_0.safetensors" in capsys.readouterr().err


# ── planted faults: each is reported and makes the CLI exit non-zero ─────────────────────────────────────


def find(ids: list[int], part: list[int], start: int = 0) -> int:
    for i in range(start, len(ids) - len(part) + 1):
        if ids[i : i + len(part)] == part:
            return i
    raise ValueError("not found")


def with_mask(sample: Sample, positions: list[int]) -> Sample:
    mask = list(sample.loss_mask)
    logprobs = list(sample.inference_logprobs)
    for i in positions:
        mask[i], logprobs[i] = True, -1.0
    return replace(sample, loss_mask=mask, inference_logprobs=logprobs)


def tool_response_position(sample, chat, tokenizer):
    return find(sample.token_ids, [chat.tool_response]) + 2  # past "<tool_response>" and "\n": the result


def user_question_position(sample, chat, tokenizer):
    return find(sample.token_ids, tokenizer.encode(QUESTION, add_special_tokens=False))


def newline_after_reply(sample, chat, tokenizer, builder):
    return builder.spans["tool_turn"][0]


def second_reply_header(sample, chat, tokenizer, builder):
    return (
        builder.spans["tool_turn"][0]
        + 1
        + find(sample.token_ids[builder.spans["tool_turn"][0] + 1 :], [chat.turn_start], 1)
    )


def scaffold_position(sample, chat, tokenizer, builder):
    return builder.spans["answer"][0] - 1  # the last "\n" of the empty think block before the answer


def system_position(sample, chat, tokenizer):
    return find(sample.token_ids, tokenizer.encode(SYSTEM, add_special_tokens=False))


@pytest.mark.parametrize(
    ("where", "check"),
    [
        (tool_response_position, "mask_in_tool_turn"),
        (user_question_position, "mask_in_user_turn"),
        (system_position, "mask_in_system_turn"),
    ],
)
def test_trainable_token_in_a_prompt_turn(tmp_path, samples, chat, tokenizer, tiny_model_path, check_loss_mask,
                                          where, check):  # fmt: skip
    tool, truncated, short = baseline(samples)
    position = where(tool, chat, tokenizer)
    write_step(tmp_path, [with_mask(tool, [position]), truncated, short], tiny_model_path)
    found = checks_found(tmp_path, chat)
    assert set(found) == {check}
    assert found[check][0].positions == [position] and found[check][0].sample == 0
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1


def test_text_output_brackets_trained_tokens(tmp_path, samples, chat, tokenizer, tiny_model_path, check_loss_mask,
                                             capsys):  # fmt: skip
    tool, truncated, short = baseline(samples)
    position = tool_response_position(tool, chat, tokenizer)
    write_step(tmp_path, [with_mask(tool, [position]), truncated, short], tiny_model_path)
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"⟦{tokenizer.decode([tool.token_ids[position]])}⟧" in out  # no colours when captured: brackets
    assert "⟦The answer is 42.<|im_end|>⟧" in out
    assert "mask_in_tool_turn" in out and "sample 0" in out and "sample 1" not in out  # only flagged samples
    assert out.strip().splitlines()[-1].startswith("step 0: 3 samples")


@pytest.mark.parametrize("where", [newline_after_reply, second_reply_header, scaffold_position])
def test_trainable_template_token(tmp_path, samples, chat, tokenizer, tiny_model_path, check_loss_mask, where):
    tool, truncated, short = baseline(samples)
    position = where(tool, chat, tokenizer, samples["tool_builder"])
    write_step(tmp_path, [with_mask(tool, [position]), truncated, short], tiny_model_path)
    found = checks_found(tmp_path, chat)
    assert "mask_on_template" in found and found["mask_on_template"][0].positions == [position]
    assert not {c for c in found if c.startswith("mask_in_")}
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1


@pytest.mark.parametrize("shift", [1, -1])
def test_mask_off_by_one_is_caught(tmp_path, samples, chat, tiny_model_path, shift):
    """A mask one token late trains the newline after <|im_end|> and misses each reply's first token; one token
    early trains the scaffold's last newline and misses each reply's <|im_end|>."""
    tool, truncated, short = baseline(samples)
    mask = [False, *tool.loss_mask[:-1]] if shift == 1 else [*tool.loss_mask[1:], False]
    logprobs = [-0.5 if m else 0.0 for m in mask]
    write_step(
        tmp_path, [replace(tool, loss_mask=mask, inference_logprobs=logprobs), truncated, short], tiny_model_path
    )
    found = checks_found(tmp_path, chat)
    assert set(found) == {"mask_on_template", "mask_gap" if shift == 1 else "unmasked_turn_end"}


def test_empty_mask(tmp_path, samples, chat, tiny_model_path, check_loss_mask, capsys):
    tool, truncated, short = baseline(samples)
    empty = replace(short, loss_mask=[False] * len(short.loss_mask), inference_logprobs=[0.0] * len(short.loss_mask))
    write_step(tmp_path, [tool, truncated, empty], tiny_model_path)
    found = checks_found(tmp_path, chat)
    assert set(found) == {"empty_mask"} and found["empty_mask"][0].sample == 2
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "empty_mask" in out and "sample 2" in out


def test_trainable_token_without_logprob(tmp_path, samples, chat, tiny_model_path, check_loss_mask):
    tool, truncated, short = baseline(samples)
    reply = [i for i, m in enumerate(short.loss_mask) if m]
    no_logprobs = replace(short, inference_logprobs=[0.0] * len(short.token_ids))  # a whole reply without any
    logprobs = list(tool.inference_logprobs)
    nan_at = tool.loss_mask.index(True)
    logprobs[nan_at] = math.nan
    write_step(tmp_path, [replace(tool, inference_logprobs=logprobs), truncated, no_logprobs], tiny_model_path)
    found = checks_found(tmp_path, chat)
    assert set(found) == {"missing_logprob", "trainer_rejects"}  # the NaN: the trainer refuses non-finite logprobs
    assert [(p.sample, p.positions) for p in found["missing_logprob"]] == [(0, [nan_at]), (2, reply)]
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1


def test_lone_zero_logprob_is_a_warning(tmp_path, samples, chat, tiny_model_path, check_loss_mask):
    """vLLM reports 0.0 for a token sampled with probability 1 (in float32): alone among real logprobs it is legal."""
    tool, truncated, short = baseline(samples)
    logprobs = list(short.inference_logprobs)
    zero_at = short.loss_mask.index(True) + 1
    logprobs[zero_at] = 0.0
    write_step(tmp_path, [tool, truncated, replace(short, inference_logprobs=logprobs)], tiny_model_path)
    found = checks_found(tmp_path, chat)
    assert set(found) == {"zero_logprob"} and found["zero_logprob"][0].severity == "warning"
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 0


def test_reply_ended_by_endoftext(tmp_path, chat, tokenizer, tiny_model_path):
    """A reply the model ended with <|endoftext|> (the server may add <|im_end|> after it): the sampled stop token
    is trainable, the added <|im_end|> and the newline are template."""
    b = Builder(tokenizer)
    b.add("prompt", render(tokenizer, [{"role": "user", "content": QUESTION}], True), sampled=False)
    b.add("reply", "42<|endoftext|>", sampled=True)
    b.add("closing", "<|im_end|>\n", sampled=False)
    b.add("next", "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n", sampled=False)
    b.add("second", "Yes.<|im_end|>", sampled=True)
    sample = b.sample(reward=1.0)
    seg = segment(sample.token_ids, chat)
    assert [t.role for t in seg.turns] == ["system", "user", "assistant", "user", "assistant"]
    closing = b.spans["closing"][0]
    assert [seg.parts[closing - 1], seg.parts[closing], seg.parts[closing + 1]] == ["end", "separator", "separator"]
    write_step(tmp_path, [sample, with_mask(sample, [closing])], tiny_model_path)
    found = checks_found(tmp_path, chat)
    assert set(found) == {"mask_on_template"} and found["mask_on_template"][0].sample == 1


def test_length_mismatch(tmp_path, samples, chat, tiny_model_path, check_loss_mask):
    def drop_last_logprob(info, micro_batches):
        micro_batches[1].inference_logprobs = micro_batches[1].inference_logprobs[:-1]

    write_step(tmp_path, baseline(samples), tiny_model_path, mutate=drop_last_logprob)
    found = checks_found(tmp_path, chat)
    assert set(found) == {"trainer_rejects"}  # the protocol's refusal, the only problem
    (problem,) = found["trainer_rejects"]
    assert re.search(r"micro_batch_1.safetensors: inference_logprobs has \d+ entries for \d+ tokens$", problem.message)
    assert [s.micro_batch for s in read_step(tmp_path).samples] == [0]  # a micro-batch that does not split: unread
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1


@pytest.mark.parametrize(
    ("fault", "refusal"),
    [("nan_advantage", "advantages or inference_logprobs hold NaN or infinite values"),
     ("float_ids", r"input_ids is torch.float32 of shape \[\d+\], expected 1-d torch.int64")],
)  # fmt: skip
def test_what_the_trainer_would_refuse_fails_the_check(tmp_path, samples, chat, tiny_model_path, check_loss_mask,
                                                       capsys, fault, refusal):  # fmt: skip
    def spoil(info, micro_batches):
        if fault == "nan_advantage":
            micro_batches[1].advantages[0] = math.nan
        else:
            micro_batches[0].input_ids = micro_batches[0].input_ids.float()

    write_step(tmp_path, baseline(samples), tiny_model_path, mutate=spoil)
    (problem,) = checks_found(tmp_path, chat)["trainer_rejects"]
    assert re.match(rf"the trainer would refuse this batch: \S+micro_batch_\d.safetensors: {refusal}$", problem.message)
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1
    assert "trainer_rejects" in capsys.readouterr().out


def test_sample_lengths_disagree_with_tensors(tmp_path, samples, chat, tiny_model_path):
    def longer_sample(info, micro_batches):
        micro_batches[0].sample_lengths = micro_batches[0].sample_lengths + 1

    write_step(tmp_path, baseline(samples), tiny_model_path, mutate=longer_sample)
    found = checks_found(tmp_path, chat)
    assert set(found) == {"trainer_rejects"} and "do not split" in found["trainer_rejects"][0].message


def test_batch_json_sample_count_disagrees(tmp_path, samples, chat, tiny_model_path, check_loss_mask):
    write_step(tmp_path, baseline(samples), tiny_model_path, mutate=lambda info, mbs: info.samples.pop())
    found = checks_found(tmp_path, chat)
    assert set(found) == {"sample_count_mismatch"}
    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--json"]) == 1


def test_json_lists_problems_and_limit(tmp_path, samples, tiny_model_path, check_loss_mask, capsys):
    tool, truncated, short = baseline(samples)
    empty = replace(short, loss_mask=[False] * len(short.loss_mask))
    write_step(tmp_path, [tool, truncated, empty], tiny_model_path)
    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--json", "--limit", "1"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and doc["by_check"] == {"empty_mask": 1} and len(doc["sample_reports"]) == 1
    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--json", "--sample", "2"]) == 1
    (listed,) = json.loads(capsys.readouterr().out)["sample_reports"]
    assert listed["index"] == 2 and listed["problems"][0]["check"] == "empty_mask"


# ── the other tools ─────────────────────────────────────────────────────────────────────────────────────


def test_inspect_rollouts_shows_the_conversation(tmp_path, samples, tiny_model_path, capsys):
    write_step(tmp_path, baseline(samples), tiny_model_path, step=1)
    inspect_rollouts = load_script("inspect_rollouts")
    assert inspect_rollouts.main(["--output-dir", str(tmp_path), "--sample", "0"]) == 0
    out = capsys.readouterr().out
    for expected in ("step 1", "sample 0", "gsm8k-calc", "correct_answer", "tool (turn 3", "The answer is 42."):
        assert expected in out
    assert inspect_rollouts.main(["--output-dir", str(tmp_path), "--sample", "9"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_inspect_rollouts_shows_the_steps_failed_rollouts_by_cause(tmp_path, samples, tiny_model_path, capsys):
    write_step(tmp_path, baseline(samples), tiny_model_path, step=1)
    traceback = 'HarnessError: exited 1: Traceback (most recent call last):\n  File "/tmp/tmp{}/run.py", line 3\n'
    traceback += "ModuleNotFoundError: No module named 'nltk'"
    failed = [
        rollout(0.0, ok=False, error=traceback.format(i), env="wiki", task=f"t{i}", seat="agent") for i in range(3)
    ]
    stack = 'Traceback (most recent call last):\n  File "harness.py", line 9, in run\nHarnessError: exited 1'
    failed[0].traceback = stack
    no_data = rollout(0.0, ok=False, error="TaskError: no data", env="wiki", task="t9", traceback="Traceback: (eval)")
    write_failed_rollouts(tmp_path, 1, [failed, [rollout(0.0, ok=False, error="TaskError: no data", env="wiki")]])
    write_failed_rollouts(tmp_path, 1, [[no_data]], evaluation=True)  # weights step 1's evaluation
    write_failed_rollouts(tmp_path, 2, [failed[:2]])  # the step stopped the run: no batch
    inspect_rollouts = load_script("inspect_rollouts")
    assert inspect_rollouts.main(["--output-dir", str(tmp_path), "--step", "1", "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert "5 failed rollouts, 3 causes" in out and "sample 0" in out
    assert "3 × HarnessError: ModuleNotFoundError: No module named 'nltk'" in out and "1 × TaskError: no data\n" in out
    assert "first: step 1 · env wiki · task t0 · seat agent" in out and f"{traceback.format(0)}\n{stack}" in out
    assert "1 × TaskError: no data (in evaluation)" in out and "first: evaluation of weights step 1 · env wiki" in out
    assert "Traceback: (eval)" in out  # each cause's first in full, with its traceback
    assert inspect_rollouts.main(["--output-dir", str(tmp_path)]) == 0  # the newest step: its failures alone
    out = capsys.readouterr().out
    assert "step 2: no batch to show" in out and "2 × HarnessError: ModuleNotFoundError" in out


def test_both_tools_show_the_sampling_truncation_the_trainer_replays(
    tmp_path, samples, tiny_model_path, check_loss_mask, capsys
):
    write_step(tmp_path, baseline(samples), tiny_model_path, step=1)
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 0
    assert "sampled at temperature 1.0, no truncation" in capsys.readouterr().out

    def truncated(info, micro_batches):
        info.truncation = Truncation(top_p=0.9, top_k=20, banned=(7, 9))

    write_step(tmp_path, baseline(samples), tiny_model_path, step=2, mutate=truncated)
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 0
    assert "sampled at temperature 1.0, top_p 0.9, top_k 20, 2 tokens banned (replayed)" in capsys.readouterr().out
    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"] == {"temperature": 1.0, "top_p": 0.9, "top_k": 20,
                                                               "min_p": 0.0, "banned": [7, 9]}  # fmt: skip
    assert load_script("inspect_rollouts").main(["--output-dir", str(tmp_path), "--sample", "0"]) == 0
    assert "top_p 0.9, top_k 20, 2 tokens banned (replayed)" in capsys.readouterr().out


def test_verify_env_rejects_bad_args_and_unknown_envs(caplog, monkeypatch, request):
    verify_env = load_script("verify_env")
    monkeypatch.setattr(verify_env, "setup_logging", lambda process: None)  # keep this process's logging as is
    quieted = logging.getLogger("orchestrator")  # main quiets it: as it was after (later tests log through it)
    request.addfinalizer(functools.partial(quieted.setLevel, quieted.level))
    with pytest.raises(SystemExit) as bad_args:
        verify_env.main(["reverse-text", "--args", "[1]"])
    assert bad_args.value.code == 1
    with pytest.raises(SystemExit) as unknown:
        verify_env.main(["no-such-env"])
    assert unknown.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.name == "verify_env"]
    assert len(errors) == 2 and all("\n" not in e for e in errors)
    assert "--args must be a JSON object" in errors[0] and "'no-such-env' is not installed" in errors[1]


def test_an_im_start_the_model_sampled_inside_its_reply_is_content(tmp_path, tokenizer, chat, tiny_model_path):
    b = Builder(tokenizer)
    b.add("prompt", render(tokenizer, [{"role": "user", "content": QUESTION}], True), sampled=False)
    b.add("reply", "It is<|im_start|>user\n 42.<|im_end|>", sampled=True)  # garbage a random model may sample
    sample = b.sample(reward=1.0, env="gsm8k-calc")
    seg = segment(sample.token_ids, chat, sample.loss_mask)
    assert [t.role for t in seg.turns] == ["system", "user", "assistant"]
    assert [t.role for t in segment(sample.token_ids, chat).turns][-1] == "user"  # without the mask: a new turn
    write_step(tmp_path, [sample], tiny_model_path, step=0)
    assert [p for p in check_step(read_step(tmp_path), chat).all_problems() if p.severity == "error"] == []


def test_tokens_the_model_sampled_after_an_endoftext_inside_its_reply_are_its_reply(
    tmp_path, tokenizer, chat, tiny_model_path, check_loss_mask
):
    """A model whose generation config stops only at <|im_end|> samples <|endoftext|> and goes on: what follows it
    up to the <|im_end|> was sampled in the assistant's turn and is trained rightly (a warning names the stop token,
    no error); a reply that ends at its <|endoftext|> still ends there."""
    b = Builder(tokenizer)
    b.add("prompt", render(tokenizer, [{"role": "user", "content": QUESTION}], True), sampled=False)
    b.add("reply", "It is<|endoftext|> 42.<|endoftext|>\n#### 42<|im_end|>", sampled=True)
    sample = b.sample(reward=1.0, env="gsm8k-calc")
    seg = segment(sample.token_ids, chat, sample.loss_mask)
    start, end = b.spans["reply"]
    assert [t.role for t in seg.turns] == ["system", "user", "assistant"] and seg.turns[-1].end == end
    assert set(seg.parts[start : end - 1]) == {"content"} and seg.parts[end - 1] == "end"
    write_step(tmp_path, [sample], tiny_model_path)
    found = checks_found(tmp_path, chat)
    endoftext = [
        i for i in range(start, end) if sample.token_ids[i] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ]
    assert set(found) == {"stop_token_in_reply"} and found["stop_token_in_reply"][0].severity == "warning"
    assert found["stop_token_in_reply"][0].positions == endoftext and len(endoftext) == 2
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 0


def llama_tool_sample(tokenizer) -> tuple[Sample, Builder]:
    """The tool sample in Llama 3's format: header turns, the call as the whole reply, the result in an ipython turn."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    b = Builder(tokenizer)
    b.add("prompt", render(tokenizer, messages, True), sampled=False)
    b.add("call", '{"name": "calculator", "parameters": {"expression": "6 * 7"}}<|eot_id|>', sampled=True)
    history = render(tokenizer, [*messages, {"role": "assistant", "content": "", "tool_calls": [CALL]}], False)
    messages += [{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": TOOL_RESULT}]
    follow_up = render(tokenizer, messages, True)
    assert follow_up.startswith(history) and history.endswith("<|eot_id|>")
    b.add("tool_turn", follow_up[len(history) :], sampled=False)
    b.add("answer", "The answer is 42.<|eot_id|>", sampled=True)
    return b.sample(reward=1.0, env="gsm8k-calc", task=7, rewards={}, truncated=False, turns=2), b


def test_llama3_turns_are_read_and_checked(tmp_path):
    from tools.tiny_model import built_model_path

    path = built_model_path("trident/tiny-llama3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = ChatFormat.from_tokenizer(tokenizer)
    sample, b = llama_tool_sample(tokenizer)
    seg = segment(sample.token_ids, chat)
    assert [t.role for t in seg.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert seg.roles[0] == "outside"  # <|begin_of_text|>
    trainable_parts = {(seg.roles[i], seg.parts[i]) for i, m in enumerate(sample.loss_mask) if m}
    assert trainable_parts == {("assistant", "content"), ("assistant", "end")}
    header = [sample.token_ids[i] for i in range(*b.spans["tool_turn"]) if seg.parts[i] == "header"]
    assert tokenizer.decode(header) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    write_step(tmp_path, [sample, replace(sample)], path)
    assert check_step(read_step(tmp_path), chat).ok

    tool_result = seg.turns[3].content_start  # the ipython turn's first content token
    assistant_header = seg.turns[4].content_start - 1  # the blank line closing the answer's header

    def plant(*positions):
        def mutate(info, micro_batches):
            for position in positions:
                micro_batches[0].loss_mask[position] = True
            info.num_loss_tokens += len(positions)

        return mutate

    write_step(tmp_path, [sample, replace(sample)], path, mutate=plant(tool_result))
    assert set(checks_found(tmp_path, chat)) >= {"mask_in_tool_turn"}
    write_step(tmp_path, [sample, replace(sample)], path, mutate=plant(assistant_header))
    assert "mask_on_template" in checks_found(tmp_path, chat)


# ── image placeholders (vision-language models) ─────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def vlm():
    """The tiny Qwen3-VL's folder, its tokenizer and chat format."""
    from tools.tiny_model import built_model_path

    path = built_model_path("trident/tiny-qwen3-vl")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return path, tokenizer, ChatFormat.from_tokenizer(tokenizer)


def image_sample(tokenizer, output_dir: Path, colours: list[str]) -> Sample:
    """A user turn showing an image of each colour (4 placeholders each, as the server expands a 64×64 image), the
    reply sampled after it; the images stored in the run at ``output_dir``."""
    import io

    from PIL import Image

    from contracts.images import store_image

    def png(colour: str) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (64, 64), colour).save(buffer, format="PNG")
        return buffer.getvalue()

    b = Builder(tokenizer)
    images = "".join("<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>" for _ in colours)
    b.add("prompt", f"<|im_start|>user\nWhat colours?{images}<|im_end|>\n<|im_start|>assistant\n", sampled=False)
    b.add("answer", " and ".join(colours) + "<|im_end|>", sampled=True)
    sample = b.sample(reward=1.0, env="shapes", task=1, rewards={}, truncated=False, turns=1)
    return replace(sample, images=[store_image(output_dir, png(colour)) for colour in colours])


def test_image_placeholders_are_counted_and_shown_as_one_label(tmp_path, vlm, check_loss_mask, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no label wrapped over two lines
    path, tokenizer, chat = vlm
    shown = image_sample(tokenizer, tmp_path, ["red", "red", "blue"])  # one image shown twice
    write_step(tmp_path, [shown, chat_sample(tokenizer)[0]], path)
    report = check_step(read_step(tmp_path), chat)
    assert report.ok, report.all_problems()
    vision_start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    starts = [i + 1 for i, token in enumerate(shown.token_ids) if token == vision_start]
    assert report.samples[0].image_runs == [(start, 4) for start in starts] and report.samples[1].image_runs == []
    assert (report.totals()["images"], report.totals()["image_tokens"]) == (3, 12)

    assert check_loss_mask.main(["--output-dir", str(tmp_path), "--all"]) == 0
    out = capsys.readouterr().out
    red, blue = shown.images[0][:8], shown.images[2][:8]
    assert out.count(f"[image {red}… 4 tokens]") == 2 and out.count(f"[image {blue}… 4 tokens]") == 1
    assert "<|image_pad|>" not in out and "12 image tokens in 3 images" in out.splitlines()[-1]
    assert load_script("inspect_rollouts").main(["--output-dir", str(tmp_path), "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert f"What colours?<|vision_start|>[image {red}… 4 tokens]<|vision_end|>" in out and "<|image_pad|>" not in out


def test_a_trained_image_token_a_wrong_image_count_and_a_missing_image_are_refused(tmp_path, vlm, check_loss_mask,
                                                                                  capsys):  # fmt: skip
    path, tokenizer, chat = vlm
    sample = image_sample(tokenizer, tmp_path, ["red", "blue"])
    pad = sample.token_ids.index(chat.image_pad)
    write_step(tmp_path, [with_mask(sample, [pad, pad + 1])], path)
    found = checks_found(tmp_path, chat)
    assert set(found) == {"mask_on_image"} and found["mask_on_image"][0].positions == [pad, pad + 1]

    write_step(tmp_path, [replace(sample, images=sample.images[:1])], path)
    assert set(checks_found(tmp_path, chat)) == {"image_count_mismatch"}

    write_step(tmp_path, [sample], path)
    (tmp_path / "images" / sample.images[1]).unlink()
    found = checks_found(tmp_path, chat)
    assert set(found) == {"image_missing"} and sample.images[1][:12] in found["image_missing"][0].message
    assert check_loss_mask.main(["--output-dir", str(tmp_path)]) == 1
    assert "image_missing" in capsys.readouterr().out


def distilled(sample: Sample, algorithm: str) -> Sample:
    """``sample`` as (self-)distillation writes it: an advantage per trained token (0 elsewhere), their mean in
    ``batch.json``, marked with ``algorithm`` ("opd" or "opsd")."""
    values = [0.25 * (i % 3) - 0.25 if m else 0.0 for i, m in enumerate(sample.loss_mask)]
    trained = [v for v, m in zip(values, sample.loss_mask, strict=True) if m]
    return replace(sample, token_advantages=values, advantage=sum(trained) / len(trained),
                   meta={**sample.meta, "algorithm": algorithm})  # fmt: skip


@pytest.mark.parametrize("algorithm", ["opd", "opsd"])
def test_a_distilled_samples_per_token_advantages_pass_unless_on_an_untrained_token(tmp_path, samples, chat,
                                                                                    tiny_model_path,
                                                                                    algorithm):  # fmt: skip
    """Varying advantages are a GRPO sample's error, a distilled one's signal (on-policy distillation's or
    self-distillation's); but a distilled token advantage off the loss mask, or a batch.json mean that is not the
    trained tokens', is still an advantage_mismatch."""
    batch = [distilled(samples["tool"], algorithm), *baseline(samples)[1:]]
    write_step(tmp_path, batch, tiny_model_path)
    assert "advantage_mismatch" not in checks_found(tmp_path, chat)

    def on_the_prompt(info, micro_batches):
        micro_batches[0].advantages[0] = 0.5  # token 0: the system prompt's first, never trained

    write_step(tmp_path, batch, tiny_model_path, mutate=on_the_prompt)
    (problem,) = checks_found(tmp_path, chat)["advantage_mismatch"]
    assert problem.message == "advantages on untrained tokens: 1 at [0]"
    write_step(tmp_path, batch, tiny_model_path, mutate=lambda info, mbs: info.samples[0].update(advantage=9.0))
    (problem,) = checks_found(tmp_path, chat)["advantage_mismatch"]
    assert problem.message.endswith("in the tensors, 9 in batch.json")


def with_ce(sample: Sample, weights: list[float], roles: list[str], algorithm: str) -> Sample:
    return replace(sample, ce_weights=weights, meta={**sample.meta, "ce_roles": roles, "algorithm": algorithm})


def test_cross_entropy_weights_pass_on_their_roles_content_and_fail_elsewhere(tmp_path, samples, chat,
                                                                              tiny_model_path):  # fmt: skip
    """ECHO's weights on the tool turn's content and a teacher's sample (weights on the assistant's tokens, no loss
    token) pass; a weight on the first token, on a turn header, or in a turn of a role not in ``ce_roles`` fails."""
    tool = samples["tool"]
    echo = with_ce(tool, echo_weights(tool.token_ids, tool.loss_mask, chat, ["tool"], 1.0), ["tool"], "echo")
    short = samples["short"]
    n = len(short.token_ids)
    taught = replace(with_ce(short, [float(m) for m in short.loss_mask], ["assistant"], "sft"), loss_mask=[False] * n,
                     inference_logprobs=[0.0] * n)  # fmt: skip
    write_step(tmp_path, [echo, taught], tiny_model_path)
    report = check_step(read_step(tmp_path), chat)
    assert report.ok and report.num_warnings == 0, report.all_problems()

    seg = segment(tool.token_ids, chat, tool.loss_mask)
    tool_turn = next(t for t in seg.turns if t.role == "tool")
    user_content = next(t for t in seg.turns if t.role == "user").content_start
    for position, check in ((0, "ce_on_first_token"), (tool_turn.start, "ce_on_template"),
                            (user_content, "ce_in_user_turn")):  # fmt: skip
        weights = list(echo.ce_weights)
        weights[position] = 1.0
        write_step(tmp_path, [with_ce(tool, weights, ["tool"], "echo"), taught], tiny_model_path)
        found = checks_found(tmp_path, chat)
        assert set(found) == {check} and found[check][0].positions == [position], found
