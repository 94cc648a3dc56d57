"""Errors an operator must read as one clear line, and the guard that turns them into an exit code."""

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def first_line(text: str, limit: int | None = None) -> str:
    """The first line of an error's text (empty for none), cut to ``limit`` characters with an ellipsis: how a long or
    multi-line error from another library is shown in one line."""
    lines = text.strip().splitlines()
    line = lines[0] if lines else ""
    return line if limit is None or len(line) <= limit else line[: limit - 1] + "…"


def error_line(error: BaseException, limit: int = 400) -> str:
    """``error`` as one line: its type, then the lines of its message that hold a letter or digit (a banner's rules of
    asterisks and blank lines dropped), joined; where it was raised from another (``raise ... from``, or while
    handling one), the chain's first, its real cause, after it: ``RuntimeError: no corpus (from LookupError: Resource
    punkt not found.)``. Cut to ``limit`` characters with an ellipsis, the cause to half of them."""
    line, root = _message_line(error), root_cause(error)
    cause = _message_line(root) if root is not error else ""
    if not cause or (cause.partition(": ")[2] or cause) in line:  # no chain, or the outer message quotes its cause
        return _cut(line, limit)
    cause = f" (from {_cut(cause, limit // 2)})"
    return _cut(line, limit - len(cause)) + cause


def root_cause(error: BaseException) -> BaseException:
    """The first exception of ``error``'s chain: following ``__cause__``, else the ``__context__`` it was raised in."""
    seen = {id(error)}
    while (earlier := error.__cause__ or (None if error.__suppress_context__ else error.__context__)) is not None:
        if id(earlier) in seen:
            break
        seen.add(id(earlier))
        error = earlier
    return error


def _message_line(error: BaseException) -> str:
    words = [line.strip() for line in str(error).splitlines() if any(c.isalnum() for c in line)]
    return f"{type(error).__name__}: {' '.join(words)}" if words else type(error).__name__


def _cut(line: str, limit: int) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"


class TridentError(Exception):
    """A failure whose message says what went wrong and what to check; shown without a traceback."""


def user_error_line(process: str, log_lines: list[str]) -> str | None:
    """The last line of ``log_lines`` (a process's log) where :func:`exit_on_user_error` said why ``process`` failed,
    from its message on; None where it said none (the process crashed, or was killed)."""
    mark = f" {process} ERROR {process} failed: "  # setup_logging's format, then exit_on_user_error's message
    found = next((line for line in reversed(log_lines) if mark in line), None)
    return None if found is None else found[found.index(mark) + len(f" {process} ERROR ") :]


@contextmanager
def exit_on_user_error(process: str) -> Iterator[None]:
    """Log a :class:`TridentError` or timeout as one line and exit 1; Ctrl-C exits 130 quietly."""
    try:
        yield
    except (TridentError, TimeoutError) as e:
        logging.getLogger(process).error(f"{process} failed: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
