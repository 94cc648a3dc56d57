"""SFT data: chat transcripts (JSONL rows ``{"messages": [...], "tools": [...]}``, tools optional) tokenized with
the model's chat template into samples whose loss mask covers exactly the tokens the model generates in assistant
turns."""

import json
import logging
from pathlib import Path

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from rl.errors import TridentError
from rl.protocol import Sample

logger = logging.getLogger("sft")

ROLES = ("system", "user", "assistant", "tool")


class SFTDataError(TridentError):
    """A data file or row that cannot be trained on; the message names the file and line."""


def read_conversations(path: Path) -> list[tuple[int, list[dict], list[dict] | None]]:
    """The conversations of a JSONL file, each with its line number and the tools it declares; a bad row raises
    naming ``path:line``."""
    if not path.is_file():
        raise SFTDataError(f"data file not found: {path}")
    conversations = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            conversations.append((line_number, check_messages(row), check_tools(row)))
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{path}:{line_number}: invalid JSON ({e})") from None
        except SFTDataError as e:
            raise SFTDataError(f"{path}:{line_number}: {e}") from None
    if not conversations:
        raise SFTDataError(f"{path}: no conversations in the file")
    return conversations


def check_messages(row: object) -> list[dict]:
    """The row's messages, checked: system/user/assistant/tool messages with string content, the first not an
    assistant's (it answers something), at least one assistant's (something to train on). Other keys of a
    message (``tool_calls``, ``reasoning_content``) go to the chat template as they are."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise SFTDataError('expected an object with "messages": a non-empty list of {"role", "content"} objects')
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise SFTDataError(
                f'messages[{i}]: expected {{"role": one of {", ".join(ROLES)}, "content": a string}}, '
                f"got {json.dumps(message)[:100]}"
            )
    if messages[0]["role"] == "assistant":
        raise SFTDataError("messages[0] is an assistant message: a conversation starts with a system or user one")
    if not any(message["role"] == "assistant" for message in messages):
        raise SFTDataError("no assistant message: nothing to train on")
    return messages


def check_tools(row: dict) -> list[dict] | None:
    """The row's ``tools`` (OpenAI function declarations, as an RL environment offers them), if any."""
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise SFTDataError('tools: expected a list of {"type": "function", "function": {...}} objects')
    return tools


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of ``messages`` (offered ``tools``) rendered with the tokenizer's chat template."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
        )
    except (TemplateError, TypeError, ValueError) as e:
        raise SFTDataError(f"the chat template cannot render this conversation: {e}") from None


def generated_length(tokenizer: PreTrainedTokenizerBase, turn_ids: list[int]) -> int:
    """How many of an assistant turn's rendered tokens the model generates: all but the whitespace the template
    writes after the end-of-turn token (generation stops at that token)."""
    n = len(turn_ids)
    while n > 0 and not tokenizer.decode(turn_ids[n - 1 : n]).strip():
        n -= 1
    return n


def conversation_samples(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None
) -> list[Sample]:
    """Tokenize a conversation into samples whose loss mask covers only what the model generates: each
    assistant turn's content and end-of-turn token, never system, user or tool tokens, nor the generation
    prompt (``<|im_start|>assistant\\n``).

    Works for any template: an assistant turn is what the rendering of the conversation up to its end adds to
    the rendering before it with the generation prompt, and the latter must be a token prefix of the former.
    A sample grows turn by turn while it is a token prefix of the next turn's prompt; a template that renders
    earlier turns differently later (Qwen3 drops their thinking) starts a new sample, as rollouts do.
    """
    samples: list[Sample] = []
    token_ids: list[int] = []
    loss_mask: list[bool] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        turn = render(tokenizer, messages[: i + 1], tools=tools)
        if turn[: len(prompt)] != prompt:
            raise SFTDataError(
                f"messages[{i}]: the chat template renders this assistant turn without the generation prompt "
                "before it, so the tokens the model generates cannot be told apart"
            )
        if prompt[: len(token_ids)] != token_ids:
            samples.append(sft_sample(token_ids, loss_mask))
            token_ids, loss_mask = [], []
        generated = generated_length(tokenizer, turn[len(prompt) :])
        loss_mask += [False] * (len(prompt) - len(loss_mask))
        loss_mask += [True] * generated + [False] * (len(turn) - len(prompt) - generated)
        token_ids = turn
    samples.append(sft_sample(token_ids, loss_mask))
    return samples


def sft_sample(token_ids: list[int], loss_mask: list[bool]) -> Sample:
    """A sample in the trainer's batch schema; SFT has no advantages or inference logprobs."""
    return Sample(token_ids, loss_mask, [0.0] * len(token_ids), advantage=0.0, reward=0.0, weight_step=0)


def load_samples(path: Path, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> list[Sample]:
    """The training samples of a JSONL file of conversations; samples longer than ``seq_len`` are dropped (and
    counted in a warning) rather than cut, which could end an answer mid-way."""
    if not tokenizer.chat_template:
        raise SFTDataError(f"the tokenizer of {tokenizer.name_or_path} has no chat template to render conversations")
    samples = []
    conversations = read_conversations(path)
    for line_number, messages, tools in conversations:
        try:
            samples += conversation_samples(tokenizer, messages, tools)
        except SFTDataError as e:
            raise SFTDataError(f"{path}:{line_number}: {e}") from None
    kept = [sample for sample in samples if len(sample.token_ids) <= seq_len]
    if len(kept) < len(samples):
        logger.warning(f"dropped {len(samples) - len(kept)} of {len(samples)} samples longer than seq_len = {seq_len}")
    if not kept:
        raise SFTDataError(f"{path}: no sample fits in seq_len = {seq_len} tokens")
    logger.info(
        f"{path}: {len(conversations)} conversations, {len(kept)} samples, "
        f"{sum(len(s.token_ids) for s in kept)} tokens, {sum(sum(s.loss_mask) for s in kept)} to train on"
    )
    return kept
