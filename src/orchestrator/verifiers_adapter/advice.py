"""verifiers' warnings in Trident's words: advice written for verifiers' own CLI (``--env.<role>.runtime.type
docker``, ``--taskset.<key>``) rewritten to the ``[[env]]`` keys that do the same in Trident."""

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

# verifiers 0.4.0's loggers whose warnings give CLI advice (its `logger.warning` calls that name a `--` flag)
ADVISING_LOGGERS = ("verifiers.v1.env", "verifiers.v1.tasksets.harbor.taskset")
REWRITES = (
    (re.compile(r"--env\.[\w<>-]+\.runtime\.type (?:docker or prime|docker|prime)"), '[[env]] runtime = "docker"'),
    (re.compile(r"--(?:env\.)?taskset\.([\w-]+)"), lambda m: f"[[env]] args.{m[1].replace('-', '_')}"),
)


def in_trident_keys(message: str) -> str:
    """``message`` with verifiers' CLI flags replaced by Trident's ``[[env]]`` keys."""
    for pattern, replacement in REWRITES:
        message = pattern.sub(replacement, message)
    return message


class TridentAdvice(logging.Filter):
    """Rewrites each record's advice with :func:`in_trident_keys`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (rewritten := in_trident_keys(message)) != message:
            record.msg, record.args = rewritten, ()
        return True


def install_advice_filter() -> None:
    """Put :class:`TridentAdvice` on the :data:`ADVISING_LOGGERS` (once)."""
    for name in ADVISING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TridentAdvice) for f in logger.filters):
            logger.addFilter(TridentAdvice())


@contextmanager
def held_warnings() -> Iterator[list[logging.LogRecord]]:
    """Hold back what the :data:`ADVISING_LOGGERS` log in the block, for the caller to :func:`release` if they
    still hold after it (a warning about the subprocess runtime does not, for an environment then run in a
    container or refused for needing one)."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    loggers = [logging.getLogger(name) for name in ADVISING_LOGGERS]
    for logger in loggers:
        logger.addFilter(hold)
    try:
        yield held
    finally:
        for logger in loggers:
            logger.removeFilter(hold)


def release(records: list[logging.LogRecord]) -> None:
    """Log the records :func:`held_warnings` held back."""
    for record in records:
        logging.getLogger(record.name).handle(record)
