"""Benchmark: seconds per RL step with generation and training in turn (``async_level = 0``) and overlapped
(``async_level = 1``), side by side against one inference server.

``uv run --no-sync python benchmarks/async_overlap.py`` (``--smoke`` for a short run on the tiny model;
``--server URL`` to use a running server, serving any model with ``[lora] max_rank`` of at least 8, instead of
starting one).

Trainer and orchestrator run as separate processes (as ``rl`` starts them) with the CPU debug configs
(``configs/debug/rl/``), the model and the size of a step set below, for ``steps`` steps per run; runs alternate
between the two async levels (0, 1, 1, 0) against the same server. The trainer exports LoRA adapters, so the
server's base weights never change, and every run starts from them (the orchestrator resets the server to its
base model when it starts).

A step's wall time is the trainer's cycle (``wait_s + train_s + save_s``: waiting for and reading the batch,
training, writing the weights), over the steps after the first ``warmup_steps``. With ``async_level = 0`` it is
the sum of the orchestrator's work (reload, generate, write the batch) and the trainer's (train, save); with
``async_level = 1`` the orchestrator generates step N while the trainer trains step N - 1, so at best a step
costs the larger of the two. Reported: level 1's step over level 0's (across runs), and each run's step over the
sum of its own phases (within a run, where changes in the machine's load cancel out).
"""

import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import common

from contracts.metrics import read_metrics

LORA_RANK = 8  # the trainer's default adapter rank; the server must accept it


@dataclass(frozen=True)
class BenchmarkConfig:
    """The size of a step and the runs of one benchmark."""

    batch_size: int  # prompts per step
    rollouts_per_example: int
    max_tokens: int  # sampled tokens per rollout, at most
    steps: int  # trainer steps per run
    warmup_steps: int  # first steps of each run left out (process start-up, the first batch)
    async_levels: tuple[int, ...]  # one run per entry, in this order
    model_shape: dict[str, int]  # overrides of the tiny model's config; empty: the tiny model itself


# A random Qwen3 with the tiny model's vocabulary, 11 M parameters. On these CPUs the tiny model trains a token
# about 8 times faster than it generates one, so its steps are nearly all generation, whatever the batch; at this
# size, with 16 rollouts of 64 tokens, training takes about half as long as generating.
FULL_MODEL = {
    "hidden_size": 384,
    "intermediate_size": 1152,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
FULL = BenchmarkConfig(
    batch_size=2, rollouts_per_example=8, max_tokens=64, steps=7, warmup_steps=2, async_levels=(0, 1, 1, 0),
    model_shape=FULL_MODEL,
)  # fmt: skip
SMOKE = BenchmarkConfig(
    batch_size=2, rollouts_per_example=2, max_tokens=8, steps=3, warmup_steps=1, async_levels=(0, 1), model_shape={}
)


def process_argv(module: str, config_file: str, shared: list[str], extra: list[str]) -> list[str]:
    """``python -m <module> @ configs/debug/rl/<config_file>`` with flags."""
    return [sys.executable, "-m", module, "@", str(common.DEBUG_CONFIGS / config_file), *shared, *extra]


def run_once(bench: BenchmarkConfig, async_level: int, server_url: str, model: str, output_dir: Path) -> dict:
    """Train ``bench.steps`` steps at ``async_level`` against the server on ``model`` (the name the server serves it
    under); the run's summary."""
    shared = ["--output-dir", str(output_dir), "--max-steps", str(bench.steps), "--model.name", model]
    trainer = process_argv("trainer.main", "train.toml", shared, ["--model.experimental.lora.rank", str(LORA_RANK)])
    orchestrator = process_argv(
        "orchestrator.main",
        "orch.toml",
        shared,
        ["--async-level", str(async_level), "--client.base-url", server_url,
         "--batch-size", str(bench.batch_size), "--rollouts-per-example", str(bench.rollouts_per_example),
         "--sampling.max-tokens", str(bench.max_tokens), "--sample-rollouts-every", "0", "--no-eval"],
    )  # fmt: skip
    common.train_run(trainer, orchestrator, output_dir, server_url)
    return summarize_run(output_dir, bench, async_level)


def medians(records: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    """The median of each of ``keys`` over ``records``."""
    return {key: statistics.median(r[key] for r in records) for key in keys}


def summarize_run(output_dir: Path, bench: BenchmarkConfig, async_level: int) -> dict:
    """One run's step times and phase medians, from the metrics both processes wrote."""
    trainer = read_metrics(output_dir, "trainer")
    orchestrator = read_metrics(output_dir, "orchestrator")
    steady_trainer, steady_orchestrator = trainer[bench.warmup_steps :], orchestrator[bench.warmup_steps :]
    step_seconds = [sum(r[key] for key in common.TRAINER_PHASES) for r in steady_trainer]
    orchestrator_phases = medians(steady_orchestrator, common.ORCHESTRATOR_PHASES)
    trainer_phases = medians(steady_trainer, common.TRAINER_PHASES)
    # the work each process does per step, its waiting left out
    orchestrator_busy = sum(orchestrator_phases[key] for key in ("reload_s", "generate_s", "write_s"))
    trainer_busy = trainer_phases["train_s"] + trainer_phases["save_s"]
    seconds_per_step = statistics.median(step_seconds)
    return {
        "async_level": async_level,
        "step_seconds": step_seconds,
        "seconds_per_step": seconds_per_step,
        "orchestrator": orchestrator_phases,
        "trainer": trainer_phases,
        "orchestrator_busy_s": orchestrator_busy,
        "trainer_busy_s": trainer_busy,
        # within one run, so changes in the machine's load between runs cancel out: about 1 when the processes
        # take turns, max / sum of the two when they overlap perfectly
        "step_over_busy_sum": seconds_per_step / (orchestrator_busy + trainer_busy),
        "busy_max_over_sum": max(orchestrator_busy, trainer_busy) / (orchestrator_busy + trainer_busy),
        "tokens": statistics.median(r["tokens"] for r in steady_trainer),
        "weight_steps": [r["weight_step"] for r in orchestrator],
    }


def level_summary(runs: list[dict]) -> dict:
    """The runs at one async level: the median step over all their steady steps, and the median over runs of
    their phases."""

    def median(key: str, part: str | None = None) -> float:
        return statistics.median(run[part][key] if part else run[key] for run in runs)

    return {
        "seconds_per_step": statistics.median(s for run in runs for s in run["step_seconds"]),
        "generate_s": median("generate_s", "orchestrator"),
        "train_s": median("train_s", "trainer"),
        "orchestrator_busy_s": median("orchestrator_busy_s"),
        "trainer_busy_s": median("trainer_busy_s"),
        "step_over_busy_sum": median("step_over_busy_sum"),
        "busy_max_over_sum": median("busy_max_over_sum"),
    }


def compare(runs: list[dict]) -> dict:
    """Step time at async level 1 against level 0, and against the bounds set by level 0's phases: their sum
    (no overlap) and their maximum (perfect overlap)."""
    levels = {level: level_summary([r for r in runs if r["async_level"] == level]) for level in (0, 1)}
    serial, overlapped = levels[0]["seconds_per_step"], levels[1]["seconds_per_step"]
    phases = (levels[0]["orchestrator_busy_s"], levels[0]["trainer_busy_s"])
    best = max(phases)
    return {
        "async_level_0": levels[0],
        "async_level_1": levels[1],
        "step_ratio_1_over_0": overlapped / serial,
        "pair_ratios_1_over_0": common.pair_ratios(runs, "async_level", 0, 1),
        "phase_sum_s": sum(phases),
        "phase_max_s": best,
        "best_ratio": best / sum(phases),  # what perfect overlap of level 0's phases would give
        "level_1_over_phase_max": overlapped / best,
        "level_1_over_phase_sum": overlapped / sum(phases),
        # share of the possible saving (level 0's step down to the larger phase) that level 1 achieves
        "overlap_efficiency": (serial - overlapped) / (serial - best) if serial > best else None,
    }


def run_benchmark(bench: BenchmarkConfig, server_url: str, work_dir: Path) -> dict:
    """Every run of ``bench`` in turn against the server; the results as a JSON-able dict."""
    config = asdict(bench) | {"lora_rank": LORA_RANK, "env": "char-target"}
    return common.alternating_runs(
        "async_overlap", config, "async_level", bench.async_levels, server_url, work_dir,
        lambda level, model, folder: run_once(bench, level, server_url, model, folder), compare,
    )  # fmt: skip


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    columns = {"s/step": "seconds_per_step", "generate_s": "generate_s", "train_s": "train_s",
               "orch busy": "orchestrator_busy_s", "train busy": "trainer_busy_s",
               "step/busy sum": "step_over_busy_sum", "max/sum": "busy_max_over_sum"}  # fmt: skip
    rows = [f"{'':14}" + "".join(f"{title:>15}" for title in columns)]
    for level in (0, 1):
        summary = result[f"async_level_{level}"]
        rows.append(f"async_level {level} " + "".join(f"{summary[key]:>15.3f}" for key in columns.values()))
    pairs = ", ".join(f"{ratio:.2f}" for ratio in result["pair_ratios_1_over_0"])
    efficiency = result["overlap_efficiency"]
    rows += [
        f"step time level 1 / level 0: {result['step_ratio_1_over_0']:.2f} (pairs of runs: {pairs}); "
        f"perfect overlap of level 0's phases: {result['best_ratio']:.2f}",
        f"level 1 step / max(phases): {result['level_1_over_phase_max']:.2f}, "
        f"/ sum(phases): {result['level_1_over_phase_sum']:.2f}; "
        f"overlap efficiency {'n/a' if efficiency is None else f'{efficiency:.0%}'}",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = common.benchmark_parser(__doc__, "async_overlap", "a short run: 3 tiny steps at each level", server=True)
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    with common.exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="trident-bench-async-", dir=args.work_dir) as tmp:
        model = None if args.server else common.benchmark_model(bench.model_shape, Path(tmp) / "model")
        with common.server_for(args.server, model, LORA_RANK, Path(tmp)) as server_url:
            result = run_benchmark(bench, server_url, Path(tmp))
    return common.report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
