"""Benchmark: seconds per RL step and the share of the run the server spent paused for reloads, with weights swapped
in flight (``[weight_sync] in_flight = true``) and waiting for the requests in flight (the default), side by side
against one server.

``uv run --no-sync python benchmarks/in_flight.py`` (``--smoke`` for a short run; ``--server URL`` to use a running
server of the tiny model, with a context of at least 4,096 tokens, instead of starting one).

The workload is the CPU debug configs (``configs/debug/rl/``: full-weight updates, ``async_level = 1``,
``overlap_steps``) with one slow multi-turn environment instead of char-target: customer-service, its scripted
customer answering each of ``max_turns`` agent turns of ``max_tokens`` sampled tokens (the tiny model never ends a
turn early). The next step's reload comes in this step's tail, while its longest rollouts are in the middle of a
model call: waiting, the server finishes those calls before the swap and admits nothing new meanwhile; in flight,
it pauses them for the swap alone. Runs alternate between the two settings (off, on, on, off, ...) against the
same server, which serves its base model again between runs.

Per run: the trainer's cycle per step (waiting for and reading the batch, training, writing the weights), its
mean over the steps after the first ``warmup_steps``; and the server's paused share, the orchestrator's
``reload_paused_s`` over those steps (no request started, nor in flight went on; waiting, the in-flight calls
finishing count, during which the server's batch only empties) over the same steps' wall time. Also the
per-token staleness the swaps left (``token_staleness_mean``, ``mixed_step_samples``).
"""

import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import common

from contracts.metrics import read_metrics
from contracts.model_path import TINY_MODEL_ID

SEQ_LEN = 4096  # a multi-turn customer-service rollout of the tiny model's tokens fits


@dataclass(frozen=True)
class BenchmarkConfig:
    batch_size: int  # prompts per step
    rollouts_per_example: int
    max_tokens: int  # sampled tokens per model call
    max_turns: int  # agent turns of a rollout
    steps: int  # trainer steps per run
    warmup_steps: int  # first steps of each run left out (process start-up, the first batches)
    in_flight: tuple[bool, ...]  # [weight_sync] in_flight of each run, in this order


FULL = BenchmarkConfig(
    batch_size=4, rollouts_per_example=4, max_tokens=512, max_turns=2, steps=8, warmup_steps=2,
    in_flight=(False, True, True, False),
)  # fmt: skip
SMOKE = BenchmarkConfig(
    batch_size=2, rollouts_per_example=2, max_tokens=16, max_turns=2, steps=3, warmup_steps=1, in_flight=(False, True)
)


def workload(bench: BenchmarkConfig, folder: Path) -> Path:
    """The orchestrator's file on top of the debug one: the slow multi-turn environment and the step's size."""
    path = folder / "workload.toml"
    path.write_text(
        f"batch_size = {bench.batch_size}\nrollouts_per_example = {bench.rollouts_per_example}\n"
        f"sample_rollouts_every = 0\n[sampling]\nmax_tokens = {bench.max_tokens}\n"
        f'[[env]]\nid = "customer-service"\nmax_turns = {bench.max_turns}\n'
    )
    return path


def run_once(bench: BenchmarkConfig, in_flight: bool, server_url: str, model: str, output_dir: Path) -> dict:
    """Train ``bench.steps`` steps; the run's step times, paused share and staleness over the steady steps."""
    output_dir.mkdir(parents=True)
    shared = ["--output-dir", str(output_dir), "--max-steps", str(bench.steps), "--seq-len", str(SEQ_LEN),
              "--model.name", model]  # fmt: skip
    common.train_run(
        [sys.executable, "-m", "trainer.main", "@", str(common.DEBUG_CONFIGS / "train.toml"), *shared],
        [sys.executable, "-m", "orchestrator.main", "@", str(common.DEBUG_CONFIGS / "orch.toml"),
         "@", str(workload(bench, output_dir)), *shared, "--no-eval", "--client.base-url", server_url,
         "--weight-sync.in-flight", str(in_flight).lower()],
        output_dir,
        server_url,
    )  # fmt: skip
    trainer = read_metrics(output_dir, "trainer")[bench.warmup_steps :]
    steady = read_metrics(output_dir, "orchestrator")[bench.warmup_steps :]
    step_seconds = [sum(r[key] for key in common.TRAINER_PHASES) for r in trainer]
    paused = [r["reload_paused_s"] for r in steady]
    return {
        "in_flight": in_flight,
        "step_seconds": step_seconds,
        "seconds_per_step": statistics.fmean(step_seconds),
        "reload_paused_s": paused,
        "paused_share": sum(paused) / sum(step_seconds),
        "generate_s": statistics.median(r["generate_s"] for r in steady),
        "turns_mean": statistics.median(r["turns_mean"] for r in steady),
        "token_staleness_mean": statistics.fmean(r["token_staleness_mean"] for r in steady),
        "mixed_step_samples": statistics.fmean(r["mixed_step_samples"] for r in steady),
        "staleness": [r["staleness"] for r in steady],
    }


def compare(runs: list[dict]) -> dict:
    """Each setting's mean step and paused share over its runs, and the on / off step ratios of neighbouring runs."""
    sides = {}
    for in_flight in (False, True):
        chosen = [run for run in runs if run["in_flight"] == in_flight]
        sides["in_flight" if in_flight else "waiting"] = {
            "seconds_per_step": statistics.fmean(s for run in chosen for s in run["step_seconds"]),
            "paused_share": statistics.fmean(run["paused_share"] for run in chosen),
            "reload_paused_s": statistics.median(p for run in chosen for p in run["reload_paused_s"]),
            **{key: statistics.fmean(run[key] for run in chosen) for key in ("token_staleness_mean",
                                                                              "mixed_step_samples")},
        }  # fmt: skip
    ratios = common.pair_ratios(runs, "in_flight", False, True)
    return {
        **sides,
        "pair_ratios_in_flight_over_waiting": ratios,
        "ratio_in_flight_over_waiting": statistics.median(ratios),
    }


def run_benchmark(bench: BenchmarkConfig, server_url: str, work_dir: Path) -> dict:
    config = asdict(bench) | {"seq_len": SEQ_LEN, "env": "customer-service", "configs": "configs/debug/rl"}
    return common.alternating_runs(
        "in_flight", config, "in_flight", bench.in_flight, server_url, work_dir,
        lambda in_flight, model, folder: run_once(bench, in_flight, server_url, model, folder), compare,
    )  # fmt: skip


def summary_table(result: dict) -> str:
    rows = [f"{'':11}{'s/step':>9}{'paused share':>14}{'paused s':>10}{'token staleness':>17}{'mixed samples':>15}"]
    for side in ("waiting", "in_flight"):
        s = result[side]
        rows.append(f"{side:<11}{s['seconds_per_step']:>9.3f}{s['paused_share']:>14.1%}{s['reload_paused_s']:>10.3f}"
                    f"{s['token_staleness_mean']:>17.3f}{s['mixed_step_samples']:>15.1%}")  # fmt: skip
    pairs = ", ".join(f"{r:.2f}" for r in result["pair_ratios_in_flight_over_waiting"])
    rows.append(f"step time in flight / waiting: {result['ratio_in_flight_over_waiting']:.2f} (pairs: {pairs})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = common.benchmark_parser(__doc__, "in_flight", "a short run: 3 tiny steps with each setting", server=True)
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    work_dir = tempfile.TemporaryDirectory(prefix="trident-bench-in-flight-", dir=args.work_dir)
    with common.exit_on_sigterm(), work_dir as tmp:
        with common.server_for(args.server, TINY_MODEL_ID, None, Path(tmp), max_model_len=SEQ_LEN) as server_url:
            result = run_benchmark(bench, server_url, Path(tmp))
    return common.report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
