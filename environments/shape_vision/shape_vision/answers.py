"""Reading a reply's answer: its words, the first one from the answer set, and how much of it is answer-set words."""

import re


def answer_words(reply: str) -> list[str]:
    """The reply's words, lower-cased, each digit a word of its own: ``"Red3 blue!"`` -> ``["red", "3", "blue"]``."""
    return re.findall(r"[a-z]+|\d", reply.lower())


def first_answer(reply: str, choices: list[str]) -> str | None:
    """The first word of ``reply`` that is one of ``choices`` (None if there is none)."""
    return next((word for word in answer_words(reply) if word in choices), None)


def answer_set_share(reply: str, choices: list[str]) -> float:
    """Share of the reply's non-space characters that spell words of ``choices`` (0 for an empty reply): for digit
    choices, char-target's digit share."""
    text = reply.lower()
    chars = sum(not c.isspace() for c in text)
    return sum(len(word) for word in answer_words(text) if word in choices) / chars if chars else 0.0
