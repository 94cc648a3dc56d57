"""Benchmark: the CPU debug run with dynamic sampling and a difficulty pool (``configs/debug/rl/filter.toml``)
against the same run without them: does it learn over 20 steps, how many groups it refills, and what that costs.

``uv run --no-sync python benchmarks/difficulty_filter.py`` (``--smoke`` for 3 small steps a run; ``--server URL``
with ``--work-dir`` under its weights root to use a running server instead of starting one).

Each run is ``rl`` on the debug configs with ``filter.toml`` laid over them (4 rollouts of at most 8 tokens per
prompt: a random tiny model's reply often holds no digit, so whole groups score 0), against one server; the runs
alternate between the filter on (refill and pool as in the file) and off (``filter.refill = false``, no pool).
The learning signal is the reward of each step's first groups (``refill/first_reward_mean``: the tasks as drawn,
before any refill, so refilling cannot raise it by picking groups) and, on held-out prompts, the debug run's
evaluation of the base, step-10 and final weights. Cost: seconds per step (the trainer's cycle, median) and the
groups sampled per step.
"""

import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import common

from contracts.metrics import read_metrics
from launch.supervise import log_tail

ROOT = Path(__file__).parents[1]
FILTER = common.DEBUG_CONFIGS / "filter.toml"
OFF = ["--orchestrator.filter.refill", "false", "--no-orchestrator.difficulty-pool"]


@dataclass(frozen=True)
class BenchmarkConfig:
    steps: int  # trainer steps per run
    batch_size: int  # prompts per step
    settings: tuple[str, ...]  # "on" or "off", one run per entry, in this order
    evaluate: bool  # the debug run's held-out evaluation at steps 0, 10 and the end
    window: int  # steps averaged at the start and at the end of a run for its reward gain


FULL = BenchmarkConfig(steps=20, batch_size=8, settings=("on", "off", "off", "on"), evaluate=True, window=5)
SMOKE = BenchmarkConfig(steps=3, batch_size=2, settings=("on", "off"), evaluate=False, window=1)


def run_once(bench: BenchmarkConfig, setting: str, server_url: str, output_dir: Path) -> dict:
    """One ``rl`` run of the debug configs with ``filter.toml`` (``setting`` "off": refill and pool off)."""
    configs = common.DEBUG_CONFIGS
    argv = [sys.executable, "-m", "launch.main", "--no-plots", "--trainer", "@", str(configs / "train.toml"),
            "--orchestrator", "@", str(configs / "orch.toml"), "@", str(FILTER), "--output-dir", str(output_dir),
            "--max-steps", str(bench.steps), "--orchestrator.batch-size", str(bench.batch_size),
            "--orchestrator.client.base-url", server_url, "--orchestrator.sample-rollouts-every", "0",
            *([] if bench.evaluate else ["--no-orchestrator.eval"]), *(OFF if setting == "off" else [])]  # fmt: skip
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=common.RUN_TIMEOUT_S, cwd=ROOT)
    finally:
        common.serve_base_model(server_url)
    if done.returncode != 0:
        raise RuntimeError(f"rl exited with code {done.returncode}:\n{done.stderr[-3000:]}\n"
                           f"{log_tail(output_dir / 'logs' / 'orchestrator.log')}")  # fmt: skip
    return summarize_run(output_dir, bench, setting, time.monotonic() - start)


def gain(values: list[float], window: int) -> float:
    """Mean of the last ``window`` values minus the mean of the first ``window``."""
    return statistics.fmean(values[-window:]) - statistics.fmean(values[:window])


def summarize_run(output_dir: Path, bench: BenchmarkConfig, setting: str, seconds: float) -> dict:
    """One run's learning curve, refills and step times, from the metrics both processes wrote."""
    orchestrator = read_metrics(output_dir, "orchestrator")
    trainer = read_metrics(output_dir, "trainer")
    # without refills a step's first groups are its batch: reward_mean is the same reward
    first = [r.get("refill/first_reward_mean", r["reward_mean"]) for r in orchestrator]
    evals = {e["step"]: e["eval/char-target/reward_mean"] for e in read_metrics(output_dir, "eval")}
    return {
        "setting": setting,
        "first_reward_mean": first,
        "batch_reward_mean": [r["reward_mean"] for r in orchestrator],
        "uniform_groups": [r["uniform_groups"] for r in orchestrator],
        "refill_groups": [r.get("refill/groups", 0) for r in orchestrator],
        "refill_unfilled": [r.get("refill/unfilled", 0) for r in orchestrator],
        "dropped_groups": [r.get("refill/dropped_groups", 0) for r in orchestrator],
        "reward_gain": gain(first, bench.window),
        "eval_reward_mean": evals,
        "eval_gain": evals[max(evals)] - evals[0] if evals else None,
        "step_seconds": [sum(r[key] for key in common.TRAINER_PHASES) for r in trainer],
        "seconds_per_step": statistics.median(sum(r[key] for key in common.TRAINER_PHASES) for r in trainer),
        "generate_s": statistics.median(r["generate_s"] for r in orchestrator),
        "run_seconds": seconds,
    }


def compare(runs: list[dict]) -> dict:
    """Per setting: the mean over its runs of the reward gain, evaluation gain, groups refilled per step and
    seconds per step; and the step time of the filter on over off."""
    summary = {}
    for setting in ("on", "off"):
        mine = [run for run in runs if run["setting"] == setting]
        evals = [run["eval_gain"] for run in mine if run["eval_gain"] is not None]
        summary[setting] = {
            "reward_gain": statistics.fmean(run["reward_gain"] for run in mine),
            "eval_gain": statistics.fmean(evals) if evals else None,
            "refill_groups_per_step": statistics.fmean(g for run in mine for g in run["refill_groups"]),
            "uniform_groups_share": statistics.fmean(u for run in mine for u in run["uniform_groups"]),
            "seconds_per_step": statistics.median(s for run in mine for s in run["step_seconds"]),
        }
    ratio = summary["on"]["seconds_per_step"] / summary["off"]["seconds_per_step"]
    return summary | {"step_ratio_on_over_off": ratio}


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    rows = [f"{'':6}{'reward gain':>13}{'eval gain':>11}{'refills/step':>14}{'uniform':>9}{'s/step':>8}"]
    for setting in ("on", "off"):
        s = result[setting]
        evals = "n/a" if s["eval_gain"] is None else f"{s['eval_gain']:.3f}"
        rows.append(f"{setting:6}{s['reward_gain']:>13.3f}{evals:>11}{s['refill_groups_per_step']:>14.2f}"
                    f"{s['uniform_groups_share']:>9.2f}{s['seconds_per_step']:>8.2f}")  # fmt: skip
    rows.append(f"seconds per step, on / off: {result['step_ratio_on_over_off']:.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = common.benchmark_parser(__doc__, "difficulty_filter", "3 small steps a run, on and off", server=True)
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    work = tempfile.TemporaryDirectory(prefix="trident-bench-filter-", dir=args.work_dir)
    with common.exit_on_sigterm(), work as tmp:
        model = None if args.server else "trident/tiny-qwen3"
        with common.server_for(args.server, model, None, Path(tmp)) as server_url:
            config = asdict(bench) | {"overlay": FILTER.read_text()}
            result = common.alternating_runs(
                "difficulty_filter", config, "setting", bench.settings, server_url, Path(tmp),
                lambda setting, model, folder: run_once(bench, setting, server_url, folder), compare,
            )  # fmt: skip
    return common.report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
