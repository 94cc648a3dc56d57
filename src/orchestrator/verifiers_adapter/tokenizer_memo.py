"""Renderers' tokenizers remember their short encodes and decodes.

At every model turn, renderers (0.1.12) encode the same few strings again (the assistant header, a turn's framing,
short tool results) and decode single tokens, each through transformers' Python wrapper, which costs far more than
the Rust tokenizer's work. Remembering them saves 5-8 % of the orchestrator's CPU per turn (docs/benchmarks.md).

The tokenizers verifiers loads for its renderers (``renderers.base.load_tokenizer``) keep the ids of strings up to
:data:`MAX_CHARS` characters and the text of up to :data:`MAX_IDS` ids. The results are the tokenizer's own: encoding
and decoding are pure functions of their input; each call gets a list or string of its own.

:func:`~orchestrator.verifiers_adapter.patches.install_patches` puts
:func:`load_memoized` for renderers' ``load_tokenizer`` in place.
"""

import functools

import renderers.base

MAX_CHARS = 64  # longest string whose ids are kept
MAX_IDS = 4  # most ids whose text is kept
ENTRIES = 4096  # of each cache, least recently used dropped first

_load_tokenizer = renderers.base.load_tokenizer


def memoized(tokenizer):
    """``tokenizer`` with ``encode`` and ``decode`` remembering short inputs (as renderers call them); other calls
    go to the tokenizer's own methods."""
    encode, decode = tokenizer.encode, tokenizer.decode

    @functools.lru_cache(maxsize=ENTRIES)
    def encoded(text: str, add_special_tokens: bool) -> tuple[int, ...]:
        return tuple(encode(text, add_special_tokens=add_special_tokens))

    @functools.lru_cache(maxsize=ENTRIES)
    def decoded(ids: tuple[int, ...], skip_special_tokens: bool) -> str:
        return decode(list(ids), skip_special_tokens=skip_special_tokens)

    def memo_encode(text, *args, add_special_tokens: bool = True, **kwargs):
        if args or kwargs or not isinstance(text, str) or len(text) > MAX_CHARS:
            return encode(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        return list(encoded(text, add_special_tokens))

    def memo_decode(ids, *args, skip_special_tokens: bool = False, **kwargs):
        if args or kwargs or not isinstance(ids, list) or len(ids) > MAX_IDS:
            return decode(ids, *args, skip_special_tokens=skip_special_tokens, **kwargs)
        return decoded(tuple(ids), skip_special_tokens)

    tokenizer.encode, tokenizer.decode = memo_encode, memo_decode
    return tokenizer


def load_memoized(model_name_or_path: str):
    """renderers' ``load_tokenizer``, its tokenizer :func:`memoized`."""
    return memoized(_load_tokenizer(model_name_or_path))
