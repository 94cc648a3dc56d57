"""``report.html``: one page with a run's plots, its resolved configs, its failed rollouts by cause and its last sample
rollouts; for several runs (a sweep's) a table comparing them first.

A sample rollout's completion shows the tokens the trainer trained on (loss mask True) highlighted when the step's
batch (``rollouts/step_N/``) is still on disk (the trainer keeps the batches of the steps shown): the row is
matched to its sample there and the sample's token runs are decoded with the run's tokenizer. Otherwise it shows the
row's decoded text.
Every piece of text is HTML-escaped.
"""

import html
import json
import logging
import math
from itertools import groupby
from pathlib import Path

from contracts.metrics import read_metrics
from contracts.protocol import REPORTED_SAMPLE_STEPS
from contracts.run_dir import configs_dir, rollouts_dir
from tools.failures import by_cause, full_error, read_failures, where
from tools.rollout_check import RolloutReadError, SampleRecord, load_tokenizer, read_step

logger = logging.getLogger("tools.report")

CONFIG_NAMES = ("trainer", "orchestrator", "inference")
ROWS_PER_STEP = 8  # at most this many rollouts of each of them
SHORTENED = " […] "  # what the orchestrator puts where it cut a long text's middle

STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1100px; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
pre { background: #f6f6f6; padding: 0.6em; white-space: pre-wrap; word-break: break-word; }
mark.trained { background: #b8f0b8; }
.meta { color: #555; }
td, th { padding: 0.2em 0.8em; text-align: left; }
"""


def write_report(out_dir: Path, runs: list[tuple[str, Path]], images: list[Path]) -> Path:
    """Write ``out_dir/report.html`` for ``runs`` (label, output_dir) showing ``images`` (files in ``out_dir``)."""
    names = ", ".join(name for name, _ in runs)
    parts = [
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>Trident report: {html.escape(names)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Trident report: {html.escape(names)}</h1>",
        "<h2>Metrics</h2>",
        *(image_tag(image, out_dir) for image in images),
    ]
    if not images:
        parts.append("<p>No metrics to plot yet.</p>")
    if len(runs) > 1:
        parts += comparison_table(runs)
    for name, output_dir in runs:
        parts += [f"<h2>Run {html.escape(name)}</h2>", f"<p class='meta'>{html.escape(str(output_dir))}</p>"]
        parts += config_sections(output_dir) + failure_sections(output_dir) + rollout_sections(output_dir)
    parts.append("</body></html>\n")
    path = out_dir / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def comparison_table(runs: list[tuple[str, Path]]) -> list[str]:
    """A row per run: how it ended (its ``summary.json``), its trainer steps, the last and best mean reward of its
    rollouts (the reward plot's)."""
    rows = ["<h2>Runs</h2>", "<table><tr><th>run</th><th>status</th><th>steps</th><th>last reward</th>"
            "<th>best reward</th></tr>"]  # fmt: skip
    for name, output_dir in runs:
        rewards = [r["reward_mean"] for r in read_metrics(output_dir, "orchestrator") if "reward_mean" in r]
        status, steps = read_summary(output_dir).get("status", "-"), len(read_metrics(output_dir, "trainer"))
        last, best = (format_value(rewards[-1]), format_value(max(rewards))) if rewards else ("-", "-")
        cells = [name, status, str(steps), last, best]
        rows.append("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>")
    return rows + ["</table>"]


def read_summary(output_dir: Path) -> dict:
    """The run's ``summary.json`` (``rl`` writes it as the run ends); empty where there is none."""
    try:
        return json.loads((Path(output_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def image_tag(image: Path, out_dir: Path) -> str:
    source = html.escape(image.relative_to(out_dir).as_posix(), quote=True)
    return f"<img src='{source}' alt='{html.escape(image.stem, quote=True)}'>"


def config_sections(output_dir: Path) -> list[str]:
    """Each resolved config the run wrote (``configs/<process>.toml``), escaped in a ``<pre>``."""
    parts = ["<h3>Configs</h3>"]
    paths = [configs_dir(output_dir) / f"{name}.toml" for name in CONFIG_NAMES]
    for path in (p for p in paths if p.is_file()):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(f"<details><summary>{html.escape(path.name)}</summary><pre>{html.escape(text)}</pre></details>")
    if len(parts) == 1:
        parts.append(f"<p>No configs in {html.escape(str(configs_dir(output_dir)))}.</p>")
    return parts


def failure_sections(output_dir: Path) -> list[str]:
    """The run's failed rollouts (``metrics/failed_rollouts.jsonl``), counted by cause over the whole run (its
    evaluations' apart): each cause with its count, the steps it met, and the first one's full error and traceback;
    nothing where none failed."""
    records = read_failures(output_dir)
    if not records:
        return []
    causes = by_cause(records)
    parts = [f"<h3>Failed rollouts</h3><p>{len(records)} failed rollouts, {len(causes)} causes</p>",
             "<table><tr><th>rollouts</th><th>cause</th><th>steps</th></tr>"]  # fmt: skip
    for group in causes:
        steps = f"{group.steps[0]}..{group.steps[-1]}" if len(group.steps) > 1 else "".join(map(str, group.steps))
        cells = [str(group.count), group.label, steps]
        parts.append("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>")
    parts.append("</table>")
    for group in causes:
        parts.append(
            f"<details><summary>{html.escape(group.label)}: the first, {html.escape(where(group.first))}</summary>"
            f"<pre>{html.escape(full_error(group.first))}</pre></details>"
        )
    return parts


def rollout_sections(output_dir: Path) -> list[str]:
    """The sample rollouts of the last :data:`~contracts.protocol.REPORTED_SAMPLE_STEPS` logged steps, trained tokens
    highlighted where the step's batch is still on disk."""
    rows = read_metrics(output_dir, "sample_rollouts")
    steps = sorted({row.get("step") for row in rows if isinstance(row.get("step"), int)})[-REPORTED_SAMPLE_STEPS:]
    parts = ["<h3>Sample rollouts</h3>"]
    if not steps:
        return parts + ["<p>No sample rollouts logged (orchestrator <code>sample_rollouts_every</code>).</p>"]
    decoder = TokenDecoder(output_dir)
    for step in reversed(steps):
        step_rows = [row for row in rows if row.get("step") == step][:ROWS_PER_STEP]
        samples = decoder.samples(step)
        parts += [f"<h4>Step {step}</h4>", f"<p class='meta'>{step_note(output_dir, step, bool(samples))}</p>"]
        parts += [rollout_html(row, decoder, samples) for row in step_rows]
    return parts


def step_note(output_dir: Path, step: int, highlighted: bool) -> str:
    """What the step's completions show: trained tokens highlighted, or why only their text."""
    if highlighted:
        return "<mark class='trained'>highlighted</mark>: tokens the trainer trained on (loss mask)"
    folder = html.escape(str(rollouts_dir(output_dir, step)))
    if rollouts_dir(output_dir, step).is_dir():
        return f"{folder} or the run's tokenizer could not be read (see the log): decoded text only"
    return f"{folder} is no longer on disk: decoded text only"


def rollout_html(row: dict, decoder: "TokenDecoder", samples: list[SampleRecord]) -> str:
    """One sample rollout: its env, task, seat (when it has one), reward, each reward function's score (a judge's
    verdict among them) and advantage, its prompt, and its completion."""
    keys = ("env", "task", *(["seat"] if row.get("seat") else []), "reward", "advantage")
    meta = " · ".join(f"{key} {format_value(row.get(key))}" for key in keys)
    if isinstance(row.get("rewards"), dict) and row["rewards"]:
        meta += " · rewards: " + ", ".join(f"{name} {format_value(v)}" for name, v in row["rewards"].items())
    if row.get("truncated"):
        meta += " · truncated"
    sample = matching_sample(row, samples, decoder)
    completion = decoder.highlighted(sample) if sample else html.escape(str(row.get("completion", "")))
    return (
        f"<div class='rollout'><p class='meta'>{html.escape(meta)}</p>"
        f"<details><summary>prompt</summary><pre>{html.escape(str(row.get('prompt', '')))}</pre></details>"
        f"<pre>{completion}</pre></div>"
    )


def format_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class TokenDecoder:
    """A step's samples and the run's tokenizer, loaded on first need; any failure means plain text."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self._tokenizer = None
        self.failed = False

    def samples(self, step: int) -> list[SampleRecord]:
        """The samples of ``rollouts/step_N/``, or [] when it is gone or the tokenizer cannot be loaded."""
        if not rollouts_dir(self.output_dir, step).is_dir() or self.tokenizer is None:
            return []
        try:
            return read_step(self.output_dir, step).samples
        except RolloutReadError as e:
            logger.warning(f"report: sample rollouts of step {step} without highlighting: {e}")
            return []

    @property
    def tokenizer(self):
        if self._tokenizer is None and not self.failed:
            try:
                self._tokenizer = load_tokenizer(self.output_dir)
            except RolloutReadError as e:
                logger.warning(f"report: sample rollouts without highlighting: {e}")
                self.failed = True
        return self._tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def highlighted(self, sample: SampleRecord) -> str:
        """The sample's completion (from its first trained token) as HTML, trained runs in ``<mark>``."""
        start = prompt_length(sample)
        positions = range(start, len(sample.token_ids))
        parts = []
        for trained, run in groupby(positions, key=lambda i: sample.loss_mask[i]):
            text = html.escape(self.decode([sample.token_ids[i] for i in run]))
            parts.append(f"<mark class='trained'>{text}</mark>" if trained else text)
        return "".join(parts)


def prompt_length(sample: SampleRecord) -> int:
    """Tokens before the sample's first trained token (the orchestrator's split of prompt and completion)."""
    return next((i for i, trained in enumerate(sample.loss_mask) if trained), len(sample.loss_mask))


def matching_sample(row: dict, samples: list[SampleRecord], decoder: TokenDecoder) -> SampleRecord | None:
    """The batch's sample of a sample-rollouts row: same env, task, reward and advantage, and the same completion
    text; None when none is certain (e.g. a multi-turn rollout whose last sample starts a new prompt)."""
    for sample in samples:
        summary = sample.summary
        if any(summary.get(key) != row.get(key) for key in ("env", "task", "seat") if key in row):
            continue
        if not all(close(summary.get(key), row.get(key)) for key in ("reward", "advantage")):
            continue
        completion = decoder.decode(sample.token_ids[prompt_length(sample) :])
        if same_text(str(row.get("completion", "")), completion):
            return sample
    return None


def close(a, b) -> bool:
    numbers = all(isinstance(x, int | float) for x in (a, b))
    return numbers and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def same_text(shown: str, full: str) -> bool:
    """Whether ``shown`` is ``full``, or ``full`` with its middle cut out by the orchestrator."""
    if shown == full:
        return True
    head, cut, tail = shown.partition(SHORTENED)
    return bool(cut) and full.startswith(head) and full.endswith(tail) and len(full) > len(shown) - len(SHORTENED)
