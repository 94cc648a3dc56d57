"""Per-step metrics as JSON lines (``metrics/<process>.jsonl``), and the logging set-up of every process."""

import json
import logging
import os
import sys
from pathlib import Path

from contracts.records import append_records, read_records
from contracts.run_dir import metrics_path
from contracts.shared_config import WandbConfig

logger = logging.getLogger("contracts.metrics")


class MetricsWriter:
    """Appends one JSON object per step; each line is flushed, so a crash loses at most the current step.

    With a ``wandb`` config, each record also goes to a W&B run whose step axis is the training step, shared by
    the trainer's and the orchestrator's runs (grouped under one name).
    """

    def __init__(self, output_dir: Path, process: str, wandb: WandbConfig | None = None):
        self.output_dir = Path(output_dir)
        self.path = metrics_path(output_dir, process)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run = start_wandb(wandb, Path(output_dir), process) if wandb else None
        self.last_step = 0  # the step of the last record written

    def write(self, record: dict) -> None:
        append_records(self.path, [record])
        self.last_step = record["step"]
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def write_eval(self, record: dict) -> None:
        """Append an evaluation's scores (``step``: the weights step evaluated) to ``metrics/eval.jsonl``; with W&B,
        log them beside the last step written, charted against ``eval/step``."""
        append_records(metrics_path(self.output_dir, "eval"), [record])
        if self.run is not None:
            self.run.define_metric("eval/*", step_metric="eval/step")
            scores = {k: v for k, v in record.items() if k != "step"}
            self.run.log({**scores, "eval/step": record["step"]}, step=self.last_step)

    def write_table(self, name: str, step: int, rows: list[dict]) -> None:
        """Append ``rows`` to ``metrics/<name>.jsonl`` and, with W&B, log them as the table ``name`` at ``step``."""
        append_records(metrics_path(self.output_dir, name), rows)
        if self.run is not None and rows:
            import wandb

            table = wandb.Table(columns=list(rows[0]), data=[list(row.values()) for row in rows])
            self.run.log({name: table}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def start_wandb(config: WandbConfig, output_dir: Path, process: str):
    """A W&B run under ``output_dir/wandb``; offline when asked to or when no API key is set."""
    import wandb  # imported only when tracking is on: it is slow to import

    offline = config.offline or not os.environ.get("WANDB_API_KEY")
    if offline and not config.offline:
        logger.info("WANDB_API_KEY is not set: W&B logs offline (upload later with `wandb sync`)")
    group = config.name or output_dir.resolve().name
    output_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=config.project,
        name=f"{group}-{process}",
        group=group,
        job_type=process,
        dir=output_dir,  # W&B adds its wandb/ folder
        mode="offline" if offline else "online",
        settings=wandb.Settings(console="off", silent=True),
    )


def eval_line(record: dict) -> str:
    """The line an evaluation's scores (a record of ``metrics/eval.jsonl``) are shown as, in the logs and by ``rl``."""
    scores = " | ".join(
        f"{key.removeprefix('eval/')} {value:.4f}"
        for key, value in record.items()
        if key.startswith("eval/") and key != "eval/seconds" and not key.endswith("/failed")
    )
    return f"eval of weights step {record['step']} | {scores} | {record['eval/seconds']:.1f}s"


def read_metrics(output_dir: Path, process: str) -> list[dict]:
    """All complete records written so far by ``process``; a line that is not one is skipped and logged once."""
    path = metrics_path(output_dir, process)
    return read_records(path) if path.exists() else []


def write_summary(output_dir: Path, status: str, wall_s: float) -> Path:
    """Write ``output_dir/summary.json`` for scripts and CI: how the run ended, its final and best metrics."""
    trainer, orchestrator = read_metrics(output_dir, "trainer"), read_metrics(output_dir, "orchestrator")
    by_step = {r["step"]: r for r in orchestrator}
    for record in trainer:  # one record per step: the trainer's numbers over the orchestrator's
        by_step[record["step"]] = by_step.get(record["step"], {}) | record
    trained = [by_step[r["step"]] for r in trainer]
    best = max(trained, key=lambda r: r["reward_mean"], default=None)
    summary = {
        "status": status,
        "steps": len(trainer),
        "wall_s": round(wall_s, 1),
        "final": trained[-1] if trained else None,
        "best_reward": {"step": best["step"], "reward_mean": best["reward_mean"]} if best else None,
    }
    path = Path(output_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return path


# Libraries whose INFO lines (one per request, file lock or download; httpx2: each MCP tool call, with its signed URL)
# would bury the one line per step: at WARNING unless the process logs at DEBUG.
THIRD_PARTY_LOGGERS = (
    "httpx",
    "httpx2",
    "httpcore",
    "httpcore2",
    "urllib3",
    "aiohttp.access",
    "datasets",
    "huggingface_hub",
    "filelock",
    "mcp",
    "verifiers",
)


def setup_logging(process: str, level: str = "INFO") -> None:
    """Log lines to stderr, prefixed with time and process; ``rl`` sends them to ``logs/<process>.log``. The
    :data:`THIRD_PARTY_LOGGERS` log warnings only, unless ``level`` is "debug"."""
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {process} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for name in THIRD_PARTY_LOGGERS:  # never below what was set already (dataset_rows keeps datasets' at CRITICAL)
        logger = logging.getLogger(name)
        logger.setLevel(logging.NOTSET if level.upper() == "DEBUG" else max(logger.level, logging.WARNING))
