"""What made rollouts fail, counted once per cause.

An error's *cause* is the line of its text that says what went wrong (:func:`error_cause`): its only line, or for a
multi-line error (a command's output, a traceback, a chain of errors) its last meaningful one, after its type. Many
rollouts meeting one cause carry per-rollout text in it (a temporary folder's name, an id, a port, the model's
reply), so they are counted under its *key* (:func:`cause_key`), the cause with that text normalised away.
"""

import re
from collections import Counter
from dataclasses import dataclass

from orchestrator.batching.rollout import Rollout

CAUSE_CHARS = 200  # of a cause, as a line of the log or the step's error shows it

# Lines that carry no cause of their own: a traceback's header and frames, the joints of a chained exception, a
# command's progress ("Cloning into '/tmp/x'..."), and carets or other punctuation alone. Indented lines (a
# traceback's frames and code, a stack's "at ..." lines) are skipped apart.
_NOT_A_CAUSE = re.compile(
    r"Traceback \(most recent call last\):|The above exception was the direct cause.*|During handling of the above"
    r".*|.*\.\.\.|[\W_]*"
)


def _long_quote(text: str) -> bool:
    """Whether quoted ``text`` is prose (the model's reply, a command line) rather than a short name."""
    return len(text) > 32 or any(c.isspace() for c in text)


# What differs from one rollout to the next, in the order replaced: (pattern, placeholder). Docs: cause_key.
_PER_ROLLOUT = [
    (re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"`]+", re.IGNORECASE), "<url>"),
    (re.compile(r"(?<![\w.:/])/[^\s'\"`:,;()\[\]]+"), "<path>"),
    (re.compile(r"(?<!\w)(['\"`])([^\n]*?)\1(?!\w)"), lambda m: "'…'" if _long_quote(m[2]) else m[0]),
    (re.compile(r"\b[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}\b|\b0x[0-9a-f]+\b", re.IGNORECASE), "<id>"),
    (re.compile(r"\b(?=[a-z_]*\d)[0-9a-f]{8,}\b|\btmp[a-z0-9_]{6,}\b", re.IGNORECASE), "<id>"),
    (re.compile(r"(?<![A-Za-z_<])\d+(?:\.\d+)*"), "<n>"),
]


def error_type(error: str | None) -> str:
    """The type an error text starts with (``"InterceptionError: unauthorized"``: ``InterceptionError``), as the
    verifiers adapter writes them; ``other`` for a text that names none."""
    head = (error or "").split(":", 1)[0].strip()
    return head if head.isidentifier() else "other"


def error_cause(error: str) -> str:
    """The line of ``error`` that names what went wrong: a one-line error whole; for a multi-line one its last line
    that is not blank, indented, a traceback's header or a chained exception's joint, a command's progress (ending
    in ``...``) or punctuation alone, after the error's type (``HarnessError: fatal: repository not found`` for a
    harness error whose message ends with git's output). Falls back to the first line where no other qualifies."""
    lines = error.strip().splitlines()
    if len(lines) <= 1:
        return lines[0] if lines else ""
    meaningful = [line for line in lines[1:] if not line[:1].isspace() and not _NOT_A_CAUSE.fullmatch(line.strip())]
    if not meaningful:
        return lines[0]
    kind = error_type(error)
    return meaningful[-1] if kind == "other" or meaningful[-1].startswith(kind) else f"{kind}: {meaningful[-1]}"


def cause_key(error: str) -> str:
    """The :func:`error_cause` of ``error`` with per-rollout text replaced by placeholders, in this order: URLs
    (``<url>``), absolute paths (``<path>``), quoted text holding a space or over 32 characters, such as the model's
    reply (``'…'``; a short quoted name like ``'nltk'`` is kept), UUIDs, ``0x`` numbers, hex ids of 8 or more
    digits and ``tmp…`` names (``<id>``), then numbers not part of a name (``<n>``; ``Qwen3`` is kept). Two errors
    with the same key count as one cause."""
    key = error_cause(error)
    for pattern, placeholder in _PER_ROLLOUT:
        key = pattern.sub(placeholder, key)
    return key


def shown(cause: str) -> str:
    """``cause`` cut to :data:`CAUSE_CHARS` with an ellipsis."""
    return cause if len(cause) <= CAUSE_CHARS else cause[: CAUSE_CHARS - 1] + "…"


@dataclass
class Cause:
    """Rollouts whose errors share a :func:`cause_key`: how many, and the first of them."""

    key: str
    count: int
    first: Rollout

    @property
    def text(self) -> str:
        """The first rollout's own cause (real paths and values, not placeholders), cut to :data:`CAUSE_CHARS`."""
        return shown(error_cause(self.first.error or ""))


def causes(rollouts: list[Rollout]) -> list[Cause]:
    """The causes of the errors of ``rollouts`` (those without one left out), the most common first (ties: the
    first met first)."""
    with_error = [r for r in rollouts if r.error]
    keys = [cause_key(r.error) for r in with_error]
    counts = Counter(keys)
    firsts = {key: rollout for key, rollout in reversed(list(zip(keys, with_error, strict=True)))}
    return [Cause(key, count, firsts[key]) for key, count in counts.most_common()]
