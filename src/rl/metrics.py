"""Per-step metrics as JSON lines (``metrics/<process>.jsonl``), and the logging set-up of every process."""

import json
import logging
import sys
from pathlib import Path

from rl.protocol import metrics_path


class MetricsWriter:
    """Appends one JSON object per step; each line is flushed, so a crash loses at most the current step."""

    def __init__(self, output_dir: Path, process: str):
        self.path = metrics_path(output_dir, process)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(output_dir: Path, process: str) -> list[dict]:
    """All complete records written so far by ``process``."""
    path = metrics_path(output_dir, process)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            break
    return records


def setup_logging(process: str, level: str = "INFO") -> None:
    """Log lines to stderr, prefixed with time and process; ``rl`` sends them to ``logs/<process>.log``."""
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {process} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # Per-request lines from HTTP clients, servers and verifiers would bury the one line per step.
    for noisy in ("httpx", "aiohttp.access", "verifiers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
