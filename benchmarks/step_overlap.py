"""Benchmark: seconds per RL step with the next step's groups started while this step's slowest rollouts finish
(``overlap_steps = true``, the default, with the default ``overlap_tail``) and without, at ``async_level = 1``,
side by side against one server.

``uv run --no-sync python benchmarks/step_overlap.py`` (``--smoke`` for a short run; ``--server URL`` to use a
running server of the tiny model, with a context of at least 4,096 tokens, instead of starting one).

The workload has a tail, as real ones do: each batch mixes a one-turn environment (char-target) with a multi-turn
one (customer-service with its scripted customer, ``max_turns`` agent turns), half the prompts each. The one-turn
rollouts finish early; the multi-turn ones are the step's tail, during which the server's batch is half empty
unless the next step's groups fill it. Trainer and orchestrator run as separate processes (as ``rl`` starts them)
with full-weight updates (the CPU debug configs' trainer); runs alternate between the two settings
(off, on, on, off, ...) against the same server, which serves its base model again between runs.

A step's wall time is the trainer's cycle (waiting for and reading the batch, training, writing the weights); a
run's seconds per step is their mean over the steps after the first ``warmup_steps``: its throughput. (With
overlap, steps alternate short and long, as two batches come close together and the next one later: a median
would pick the short ones.) Reported per setting: the mean step over its runs, the orchestrator's median
``generate_s`` and ``started_early_s``; and on / off for each pair of neighbouring runs, with their median.
"""

import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import common

from contracts.metrics import read_metrics
from contracts.model_path import TINY_MODEL_ID

ASYNC_LEVEL = 1
SEQ_LEN = 4096  # a multi-turn customer-service rollout of the tiny model's tokens fits


@dataclass(frozen=True)
class BenchmarkConfig:
    batch_size: int  # prompts per step, half of them multi-turn
    rollouts_per_example: int
    max_tokens: int  # sampled tokens per model call, at most
    max_turns: int  # agent turns of a multi-turn rollout
    steps: int  # trainer steps per run
    warmup_steps: int  # first steps of each run left out (process start-up, the first batches); an even number
    # of steps left, as overlapped steps alternate short and long
    overlap: tuple[bool, ...]  # overlap_steps of each run, in this order


FULL = BenchmarkConfig(
    batch_size=8, rollouts_per_example=8, max_tokens=32, max_turns=4, steps=11, warmup_steps=3,
    overlap=(False, True, True, False, False, True),
)  # fmt: skip
SMOKE = BenchmarkConfig(
    batch_size=2, rollouts_per_example=2, max_tokens=8, max_turns=2, steps=3, warmup_steps=1, overlap=(False, True)
)


def orchestrator_config(bench: BenchmarkConfig, model: str, folder: Path) -> Path:
    """The orchestrator's config file of the workload: the two environments, half the prompts each."""
    path = folder / "orch.toml"
    path.write_text(
        f'async_level = {ASYNC_LEVEL}\nseq_len = {SEQ_LEN}\nbatch_size = {bench.batch_size}\n'
        f'rollouts_per_example = {bench.rollouts_per_example}\nsample_rollouts_every = 0\n'
        f'[model]\nname = "{model}"\n[sampling]\ntemperature = 1.0\nmax_tokens = {bench.max_tokens}\n'
        f'[[env]]\nid = "char-target"\n[[env]]\nid = "customer-service"\nmax_turns = {bench.max_turns}\n'
    )  # fmt: skip
    return path


def run_once(bench: BenchmarkConfig, overlap: bool, server_url: str, model: str, output_dir: Path) -> dict:
    """Train ``bench.steps`` steps; the run's step times and the orchestrator's phases over the steady steps."""
    output_dir.mkdir(parents=True)
    shared = ["--output-dir", str(output_dir), "--max-steps", str(bench.steps), "--seq-len", str(SEQ_LEN)]
    common.train_run(
        [sys.executable, "-m", "trainer.main", "@", str(common.DEBUG_CONFIGS / "train.toml"), *shared,
         "--model.name", model],
        [sys.executable, "-m", "orchestrator.main", "@", str(orchestrator_config(bench, model, output_dir)), *shared,
         "--client.base-url", server_url, "--overlap-steps", str(overlap).lower()],
        output_dir,
        server_url,
    )  # fmt: skip
    trainer = read_metrics(output_dir, "trainer")[bench.warmup_steps :]
    orchestrator = read_metrics(output_dir, "orchestrator")
    steady = orchestrator[bench.warmup_steps :]
    step_seconds = [sum(r[key] for key in common.TRAINER_PHASES) for r in trainer]
    return {
        "overlap_steps": overlap,
        "step_seconds": step_seconds,
        "seconds_per_step": statistics.fmean(step_seconds),
        "generate_s": statistics.median(r["generate_s"] for r in steady),
        "started_early_s": statistics.median(r["started_early_s"] for r in steady),
        "turns_mean": statistics.median(r["turns_mean"] for r in steady),
        "reward_mean": [r["reward_mean"] for r in orchestrator],
        "staleness": [r["staleness"] for r in orchestrator],
    }


def compare(runs: list[dict]) -> dict:
    """Each setting's median step and phases over its runs, and the on / off ratios with their spread."""
    sides = {}
    for overlap in (False, True):
        chosen = [run for run in runs if run["overlap_steps"] == overlap]
        sides["on" if overlap else "off"] = {
            "seconds_per_step": statistics.fmean(s for run in chosen for s in run["step_seconds"]),
            **{key: statistics.median(run[key] for run in chosen) for key in ("generate_s", "started_early_s")},
        }
    ratios = common.pair_ratios(runs, "overlap_steps", False, True)
    return {
        **sides,
        "pair_ratios_on_over_off": ratios,
        "ratio_on_over_off": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }


def run_benchmark(bench: BenchmarkConfig, server_url: str, work_dir: Path) -> dict:
    config = asdict(bench) | {"async_level": ASYNC_LEVEL, "envs": ["char-target", "customer-service"]}
    return common.alternating_runs(
        "step_overlap", config, "overlap_steps", bench.overlap, server_url, work_dir,
        lambda overlap, model, folder: run_once(bench, overlap, server_url, model, folder), compare,
    )  # fmt: skip


def summary_table(result: dict) -> str:
    rows = [f"{'':16}{'s/step':>10}{'generate_s':>12}{'started early s':>17}"]
    for side in ("off", "on"):
        summary = result[side]
        rows.append(
            f"overlap_steps {side:<3}{summary['seconds_per_step']:>9.3f}{summary['generate_s']:>12.3f}"
            f"{summary['started_early_s']:>17.3f}"
        )
    ratio = result["ratio_on_over_off"]
    pairs = ", ".join(f"{r:.2f}" for r in result["pair_ratios_on_over_off"])
    rows.append(f"step time on / off: {ratio['median']:.2f} (pairs: {pairs})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = common.benchmark_parser(
        __doc__, "step_overlap", "a short run: 3 tiny steps with each setting", server=True
    )
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    work_dir = tempfile.TemporaryDirectory(prefix="trident-bench-overlap-", dir=args.work_dir)
    with common.exit_on_sigterm(), work_dir as tmp:
        with common.server_for(args.server, TINY_MODEL_ID, None, Path(tmp), max_model_len=SEQ_LEN) as server_url:
            result = run_benchmark(bench, server_url, Path(tmp))
    return common.report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
