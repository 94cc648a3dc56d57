"""``uv run trident-plot OUTPUT_DIR [OUTPUT_DIR ...] [--out DIR]``: a run's metrics as PNGs and one HTML page.

Reads each run's ``metrics/{trainer,orchestrator,eval}.jsonl`` and draws one PNG per quantity (reward, its reward
functions' scores, each seat's reward, eval scores, loss, entropy, mismatch, lengths, truncation, throughput) against
the training step, every run on the same axes, labelled by its folder name; then writes ``report.html`` beside them
(:mod:`tools.report`), which compares several runs in a table. A folder that holds no run but runs in its subfolders
(a sweep's output_dir, each run in ``<run id>/``) stands for those runs. Without ``--out`` both go to ``<first
OUTPUT_DIR>/plots/``. ``rl`` writes them at the end of every finished run, and of every sweep.
"""

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from contracts.errors import TridentError, exit_on_user_error
from contracts.metrics import read_metrics, setup_logging
from contracts.run_dir import metrics_path

PROCESSES = ("trainer", "orchestrator", "eval")  # metrics/<name>.jsonl
LINE_STYLES = ("-", "--", ":", "-.")  # one per key of a plot; colours tell the runs apart
EVAL_PREFIX = "eval/"
REWARD_PREFIX = "reward/"  # the orchestrator's reward/<function>: each reward function's mean score
SEAT_PREFIX = "seat/"  # the orchestrator's seat/<seat>/<metric>: each seat's, in a multi-agent run


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: the metrics drawn on its axes, each key with the process that logs it."""

    name: str  # the file is <name>.png
    title: str
    unit: str
    series: dict[str, str]  # key -> "trainer" or "orchestrator"


PLOTS = (
    PlotSpec("reward", "mean reward", "reward", {"reward_mean": "orchestrator"}),
    PlotSpec("loss", "policy loss", "loss", {"loss": "trainer"}),
    PlotSpec("entropy", "entropy over trained tokens", "nats", {"entropy": "trainer"}),
    PlotSpec("mismatch", "trainer vs server mismatch", "nats", {"mismatch_kl": "trainer", "probe_gap": "orchestrator"}),
    PlotSpec(
        "lengths",
        "completion length",
        "tokens",
        {"completion_len_mean": "orchestrator", "completion_len_max": "orchestrator"},
    ),
    PlotSpec("truncation", "truncated rollouts", "share", {"truncated_rate": "orchestrator"}),
    PlotSpec("rollouts_per_s", "rollout throughput", "rollouts/s", {"rollouts_per_s": "orchestrator"}),
    PlotSpec(
        "tokens_per_s",
        "token throughput",
        "tokens/s",
        {"sampled_tokens_per_s": "orchestrator", "tokens_per_s": "trainer"},
    ),
)


@dataclass
class RunMetrics:
    """The per-step records of one run, by process."""

    name: str  # the label of its lines
    output_dir: Path
    records: dict[str, list[dict]]


@dataclass
class Plot:
    """A written PNG, with what was drawn on it (for tests and the report)."""

    name: str
    path: Path
    title: str
    series: dict[str, tuple[list[float], list[float]]]  # label -> (steps, values)
    ylim: tuple[float, float]


def load_run(output_dir: Path, name: str | None = None) -> RunMetrics:
    """The metrics of the run in ``output_dir``; a :class:`TridentError` when the folder holds no run."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise TridentError(f"{output_dir}: no such folder (expected a run's output_dir)")
    if not has_metrics(output_dir):
        raise TridentError(
            f"{output_dir} is not a run's output_dir: it has no metrics/trainer.jsonl or metrics/orchestrator.jsonl"
        )
    records = {process: read_metrics(output_dir, process) for process in PROCESSES}
    return RunMetrics(name or output_dir.resolve().name, output_dir, records)


def has_metrics(folder: Path) -> bool:
    return any(metrics_path(folder, process).is_file() for process in PROCESSES)


def runs_in(folder: Path) -> list[Path]:
    """``folder`` when it holds a run (or nothing at all: :func:`load_run` says so); where it holds no run but its
    subfolders do (a sweep's output_dir), those, by name."""
    folder = Path(folder)
    inner = sorted(sub for sub in folder.iterdir() if sub.is_dir() and has_metrics(sub)) if folder.is_dir() else []
    return [folder] if has_metrics(folder) or not inner else inner


def run_labels(output_dirs: Sequence[Path]) -> list[str]:
    """Each run's folder name; the last two path parts instead when two runs share a folder name."""
    names = [Path(d).resolve().name for d in output_dirs]
    if len(set(names)) == len(names):
        return names
    return ["/".join(Path(d).resolve().parts[-2:]) for d in output_dirs]


def load_runs(output_dirs: Sequence[Path]) -> list[RunMetrics]:
    return [load_run(d, label) for d, label in zip(output_dirs, run_labels(output_dirs), strict=True)]


def metric_series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of the records that hold a step and a finite number under ``key``."""
    steps, values = [], []
    for record in records:
        step, value = record.get("step"), record.get(key)
        if isinstance(step, int) and is_number(value) and math.isfinite(value):
            steps.append(step)
            values.append(float(value))
    return steps, values


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_score(key: str) -> bool:
    """An evaluation's score (``eval/<env>/<metric>``, or a seat's ``eval/<env>/<seat>/<metric>``), not its count of
    failed rollouts or its seconds."""
    return key.startswith(EVAL_PREFIX) and key.count("/") in (2, 3) and not key.endswith("/failed")


def found_spec(runs: list[RunMetrics], spec: PlotSpec, process: str, wanted: Callable[[str], bool]) -> PlotSpec:
    """``spec`` drawing every key of ``process``'s records in any run that is ``wanted`` (none: an empty plot)."""
    found = {key for run in runs for record in run.records[process] for key in record if wanted(key)}
    return replace(spec, series=dict.fromkeys(sorted(found), process))


def eval_spec(runs: list[RunMetrics]) -> PlotSpec:
    """The plot of every evaluation score in any run's ``metrics/eval.jsonl``."""
    return found_spec(runs, PlotSpec("eval", "eval scores", "score", {}), "eval", is_score)


def reward_functions_spec(runs: list[RunMetrics]) -> PlotSpec:
    """The plot of each reward function's mean raw score (``reward/<function>``, an ``[env.judge]``'s share of yes
    verdicts among them): what ``reward_mean`` is made of."""
    spec = PlotSpec("reward_functions", "reward functions (mean raw score, unweighted)", "score", {})
    return found_spec(runs, spec, "orchestrator", lambda key: key.startswith(REWARD_PREFIX))


def seats_spec(runs: list[RunMetrics]) -> PlotSpec:
    """The plot of each seat's mean reward (``seat/<seat>/reward_mean``), in a run whose steps hold several seats."""
    spec = PlotSpec("seats", "mean reward per seat", "reward", {})
    return found_spec(
        runs, spec, "orchestrator", lambda key: key.startswith(SEAT_PREFIX) and key.endswith("/reward_mean")
    )


def series_label(run: RunMetrics, key: str, several_runs: bool, several_keys: bool) -> str:
    parts = ([run.name] if several_runs else []) + ([key] if several_keys or not several_runs else [])
    return " ".join(parts)


def draw(spec: PlotSpec, runs: list[RunMetrics], out_dir: Path) -> Plot | None:
    """Write ``<out_dir>/<spec.name>.png``; None (nothing written) when no run has any of its keys."""
    from matplotlib.figure import Figure  # alone it draws with Agg and leaves pyplot's global state alone
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 4), dpi=100)
    axes = figure.add_subplot()
    drawn = {}
    for color, run in enumerate(runs):
        for style, (key, process) in enumerate(spec.series.items()):
            steps, values = metric_series(run.records[process], key)
            if not steps:
                continue
            label = series_label(run, key, len(runs) > 1, len(spec.series) > 1)
            axes.plot(steps, values, f"C{color % 10}", linestyle=LINE_STYLES[style % len(LINE_STYLES)],
                      marker=".", label=label)  # fmt: skip
            drawn[label] = (steps, values)
    if not drawn:
        return None
    axes.set(title=spec.title, xlabel="step", ylabel=spec.unit)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 2.5
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    path = out_dir / f"{spec.name}.png"
    figure.savefig(path)
    return Plot(spec.name, path, spec.title, drawn, axes.get_ylim())


def write_plots(runs: list[RunMetrics], out_dir: Path) -> list[Plot]:
    """Draw every plot that has data into ``out_dir``; returns those written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = (PLOTS[0], reward_functions_spec(runs), seats_spec(runs), eval_spec(runs), *PLOTS[1:])  # rewards first
    return [plot for spec in specs if (plot := draw(spec, runs, out_dir)) is not None]


def plot_runs(output_dirs: Sequence[Path], out_dir: Path | None = None) -> Path:
    """Plots of the runs in ``output_dirs`` (a sweep's folder: its runs, :func:`runs_in`) and their ``report.html``
    in ``out_dir`` (default: the first folder's ``plots/``); returns the report's path."""
    from tools.report import write_report  # reads rollout batches with torch: imported once the arguments are good

    if not output_dirs:
        raise TridentError("no output_dir given: name at least one run's output_dir")
    runs = load_runs([run for folder in output_dirs for run in runs_in(folder)])
    out_dir = Path(out_dir) if out_dir is not None else Path(output_dirs[0]) / "plots"
    plots = write_plots(runs, out_dir)
    return write_report(out_dir, [(run.name, run.output_dir) for run in runs], [p.path for p in plots])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trident-plot", description=__doc__.splitlines()[0].split(": ", 1)[1])
    folder = "a run's (or a sweep's) output_dir"
    parser.add_argument("output_dirs", type=Path, nargs="+", metavar="OUTPUT_DIR", help=folder)
    parser.add_argument("--out", type=Path, help="where to write (default: <first OUTPUT_DIR>/plots)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging("trident-plot")
    with exit_on_user_error("trident-plot"):
        report = plot_runs(args.output_dirs, args.out)
    print(f"wrote {report} and its plots")


if __name__ == "__main__":
    main()
