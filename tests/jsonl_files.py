"""JSON-lines data files as a user writes them, for the tests of what reads them."""

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list) -> str:
    """Write ``rows`` to ``path``, one a line: an object as JSON, a string as it is (a blank or malformed line);
    returns the path as a string."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)
