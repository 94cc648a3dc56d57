"""SFT data: chat transcripts (rows ``{"messages": [...], "tools": [...]}``, tools optional, of any dataset
:mod:`dataset_rows` reads) tokenized with the model's chat template into samples whose loss mask covers exactly the
tokens the model generates in assistant turns."""

import itertools
import json
import logging
from collections.abc import Iterable, Iterator

from dataset_rows import DatasetError, DatasetSpec, Row, read_rows, without_nulls
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from contracts.errors import TridentError
from contracts.protocol import Sample

logger = logging.getLogger("sft")

ROLES = ("system", "user", "assistant", "tool")


class SFTDataError(TridentError):
    """A data file or row that cannot be trained on; the message names the file and line."""


def data_rows(data: DatasetSpec, shuffle_seed: int | None = None) -> Iterator[Row]:
    """The rows of ``data`` (:func:`dataset_rows.read_rows`), a dataset that cannot be read an :class:`SFTDataError`."""
    try:
        yield from read_rows(data, shuffle_seed)
    except DatasetError as e:
        raise SFTDataError(str(e)) from None


def row_samples(tokenizer: PreTrainedTokenizerBase, rows: Iterable[Row]) -> Iterator[Sample]:
    """The samples of each row's conversation (:func:`conversation_samples`), in order; a bad row raises naming
    ``file:line`` (or ``file:row``). Null fields are absent ones (:func:`dataset_rows.without_nulls`)."""
    for row in rows:
        try:
            conversation = without_nulls(row.data)
            yield from conversation_samples(tokenizer, check_messages(conversation), check_tools(conversation))
        except SFTDataError as e:
            raise SFTDataError(f"{row.where}: {e}") from None


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


def load_samples(data: DatasetSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> list[Sample]:
    """The training samples of a dataset of conversations, all checked before training; samples longer than
    ``seq_len`` are dropped (and counted in a warning) rather than cut, which could end an answer mid-way."""
    check_chat_template(tokenizer)
    rows = list(data_rows(data))
    samples = list(row_samples(tokenizer, rows))
    kept = [sample for sample in samples if len(sample.token_ids) <= seq_len]
    check_kept(data, len(kept), len(samples), seq_len)
    logger.info(
        f"{data.path}: {len(rows)} conversations, {len(kept)} samples, "
        f"{sum(len(s.token_ids) for s in kept)} tokens, {sum(sum(s.loss_mask) for s in kept)} to train on"
    )
    return kept


def stream_samples(
    data: DatasetSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int | None
) -> Iterator[Sample]:
    """The training samples of a dataset of conversations read as they are used, pass after pass; each pass in a
    new order (seeded by ``seed`` and the pass, within ``data.shuffle_buffer`` rows) unless ``seed`` is None. Rows
    are checked as they are read; samples longer than ``seq_len`` are dropped, as :func:`load_samples` does."""
    check_chat_template(tokenizer)
    for epoch in itertools.count():
        kept = total = 0
        for sample in row_samples(tokenizer, data_rows(data, None if seed is None else seed + epoch)):
            total += 1
            if len(sample.token_ids) <= seq_len:
                kept += 1
                yield sample
        check_kept(data, kept, total, seq_len)


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        raise SFTDataError(f"the tokenizer of {tokenizer.name_or_path} has no chat template to render conversations")


def check_kept(data: DatasetSpec, kept: int, total: int, seq_len: int) -> None:
    """Warn about the samples dropped for being longer than ``seq_len``; raise when none is left."""
    if not total:
        raise SFTDataError(f"{data.path}: no conversations in the data")
    if not kept:
        raise SFTDataError(f"{data.path}: no sample fits in seq_len = {seq_len} tokens")
    if kept < total:
        logger.warning(f"dropped {total - kept} of {total} samples longer than seq_len = {seq_len}")
