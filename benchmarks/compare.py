"""Rerun the side-by-side benchmarks and compare each ratio with its last recorded value: a report, not a test.

Each benchmark below measures two settings side by side in one run and records a ratio (with its repetitions where it
ran several). This reruns them one after another (each in its own process, writing to a scratch folder, never over
``benchmarks/results``), then prints, per ratio, the recorded value and spread, the new ones, and whether the new
value moved beyond the recorded spread. A ratio recorded without repetitions has no spread: a change of more than
``--tolerance`` (default 10 %) counts as moved. ``--results DIR`` compares results already written to DIR (by the
benchmarks' own ``--output``) without running anything; ``--only`` picks benchmarks by name.

    uv run --no-sync python benchmarks/compare.py                 # everything: hours on two cores
    uv run --no-sync python benchmarks/compare.py --only trl_grpo_larger async_overlap
"""

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Ratio:
    """One recorded ratio: the benchmark script that measures it (with ``argv``), the results file it writes, the
    dotted key of the ratio there, and the dotted key of its repetitions (a list), if it records them."""

    name: str
    script: str
    results: str
    value: str
    repetitions: str | None = None
    argv: tuple[str, ...] = ()


RATIOS = (
    Ratio("trl_grpo", "trl_grpo", "trl_grpo.json", "trident_speedup_per_step.median", "trident_speedup_per_step.each"),
    Ratio(
        "trl_grpo_larger",
        "trl_grpo",
        "trl_grpo_larger.json",
        "trident_speedup_per_step.median",
        "trident_speedup_per_step.each",
        ("--larger",),
    ),  # fmt: skip
    Ratio(
        "trainer_throughput",
        "trainer_throughput",
        "trainer_throughput.json",
        "trident_over_plain.tokens_per_s.paired_median",
        "trident_over_plain.tokens_per_s.paired",
    ),  # fmt: skip
    Ratio("async_overlap", "async_overlap", "async_overlap.json", "step_ratio_1_over_0", "pair_ratios_1_over_0"),
    Ratio("step_overlap", "step_overlap", "step_overlap.json", "ratio_on_over_off.median", "pair_ratios_on_over_off"),
    Ratio(
        "in_flight", "in_flight", "in_flight.json", "ratio_in_flight_over_waiting", "pair_ratios_in_flight_over_waiting"
    ),  # fmt: skip
    Ratio("server_scaling", "server_scaling", "server_scaling.json", "speedup", "speedup_pairs"),
    Ratio("server_start", "server_start", "server_start.json", "spawn_over_fork.cpu_s", "pair_ratios.cpu_s"),
    Ratio("difficulty_filter", "difficulty_filter", "difficulty_filter.json", "step_ratio_on_over_off"),
    Ratio("context_parallel", "context_parallel", "context_parallel.json", "ratios.cp_2_over_cp_1_step_s"),
    Ratio("shared_fleet", "shared_fleet", "shared_fleet.json", "wall_ratio"),
    Ratio("logprob_memory", "logprob_memory", "logprob_memory.json", "unchunked_over_chunked_peak"),
    Ratio(
        "shared_prefix",
        "shared_prefix",
        "shared_prefix.json",
        "cpu_ratio_off_over_on.median",
        "cpu_ratio_off_over_on.each",
    ),  # fmt: skip
)


@dataclass(frozen=True)
class Reading:
    """A ratio as one results file gives it: its value and the range of its repetitions (the value alone if none)."""

    value: float
    low: float
    high: float
    repetitions: int


def read_ratio(result: dict, ratio: Ratio) -> Reading:
    """``ratio``'s value and spread in one benchmark's results."""
    value = float(_lookup(result, ratio.value))
    each = [float(x) for x in _lookup(result, ratio.repetitions)] if ratio.repetitions else [value]
    return Reading(value, min(each), max(each), len(each))


def _lookup(result: dict, dotted: str):
    for key in dotted.split("."):
        result = result[key]
    return result


def moved(recorded: Reading, new: Reading, tolerance: float) -> str:
    """``"up"`` or ``"down"`` where ``new``'s value left the recorded spread (with one repetition recorded, the
    recorded value ± ``tolerance`` as a fraction), else ``"within"``."""
    low, high = recorded.low, recorded.high
    if recorded.repetitions == 1:
        low, high = recorded.value * (1 - tolerance), recorded.value * (1 + tolerance)
    return "up" if new.value > high else "down" if new.value < low else "within"


MACHINE_KEYS = ("cpu", "cpu_capability", "cores")  # what makes another machine (its load is the noise a spread covers)


def machine_change(recorded: dict, new: dict) -> str | None:
    """How the machine ``new`` results ran on differs from ``recorded``'s (CPU model, widest vector ops torch uses,
    cores), or None: a ratio measured on another machine may move for that alone."""
    before, after = recorded.get("machine", {}), new.get("machine", {})
    changes = [f"{key} {before.get(key, 'not recorded')} -> {after.get(key, 'not recorded')}"
               for key in MACHINE_KEYS if before.get(key) != after.get(key)]  # fmt: skip
    return ", ".join(changes) or None


def compare(ratios: list[Ratio], new_dir: Path, recorded_dir: Path, tolerance: float) -> list[dict]:
    """One row per ratio whose new results exist in ``new_dir``: recorded and new readings, and the verdict."""
    rows = []
    for ratio in ratios:
        new_file, recorded_file = new_dir / ratio.results, recorded_dir / ratio.results
        if not new_file.is_file():
            rows.append({"name": ratio.name, "verdict": "not run"})
            continue
        new = read_ratio(json.loads(new_file.read_text()), ratio)
        if not recorded_file.is_file():
            rows.append({"name": ratio.name, "new": new, "verdict": "nothing recorded"})
            continue
        new_result, recorded_result = json.loads(new_file.read_text()), json.loads(recorded_file.read_text())
        recorded = read_ratio(recorded_result, ratio)
        rows.append({"name": ratio.name, "recorded": recorded, "new": new, "verdict": moved(recorded, new, tolerance),
                     "machine": machine_change(recorded_result, new_result)})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    """The comparison as a text table."""

    def shown(reading: Reading | None) -> str:
        if reading is None:
            return "-"
        spread = f" ({reading.low:.3g}-{reading.high:.3g}, {reading.repetitions}x)" if reading.repetitions > 1 else ""
        return f"{reading.value:.3g}{spread}"

    lines = [f"{'ratio':<20} {'recorded':<28} {'new':<28} verdict"]
    for row in rows:
        lines.append(f"{row['name']:<20} {shown(row.get('recorded')):<28} {shown(row.get('new')):<28} {row['verdict']}")
    lines += [f"({row['name']}: another machine: {row['machine']})" for row in rows if row.get("machine")]
    return "\n".join(lines)


def rerun(ratio: Ratio, out_dir: Path) -> bool:
    """Run ``ratio``'s benchmark at full size, its results to ``out_dir``; whether it succeeded."""
    script = Path(__file__).parent / f"{ratio.script}.py"
    argv = [sys.executable, str(script), *ratio.argv, "--output", str(out_dir / ratio.results)]
    print(f"running {ratio.name}: {' '.join(argv[1:])}", flush=True)
    return subprocess.run(argv).returncode == 0


def main(argv: list[str] | None = None) -> int:
    """Rerun (or read from ``--results``) the benchmarks chosen and print the comparison; exit 1 if any moved."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [ratio.name for ratio in RATIOS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"some of: {', '.join(names)}")
    parser.add_argument("--results", type=Path, help="compare the results files already in this folder; run none")
    parser.add_argument("--recorded", type=Path, default=RESULTS_DIR, help="the recorded results (default: ours)")
    parser.add_argument("--tolerance", type=float, default=0.1, help="for ratios recorded without repetitions")
    args = parser.parse_args(argv)
    ratios = [ratio for ratio in RATIOS if not args.only or ratio.name in args.only]
    with tempfile.TemporaryDirectory(prefix="trident-bench-compare-") as scratch:
        new_dir = args.results or Path(scratch)
        if args.results is None:
            failed = [ratio.name for ratio in ratios if not rerun(ratio, new_dir)]
            if failed:
                print(f"failed: {', '.join(failed)}", file=sys.stderr)
        rows = compare(ratios, new_dir, args.recorded, args.tolerance)
    print(table(rows))
    return 1 if any(row["verdict"] in ("up", "down") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
