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


class TridentError(Exception):
    """A failure whose message says what went wrong and what to check; shown without a traceback."""


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
