"""Benchmark: on-policy distillation from a trained teacher against RL alone, on the CPU debug run: reward per step of
both, side by side, repeated.

``uv run --no-sync python benchmarks/distill_vs_rl.py`` (``--smoke`` for a 2-step teacher and 2-step runs;
``--server URL`` with ``--work-dir`` under its weights root to use a running server for the student).

The teacher is trained by the project itself: the debug run (``configs/debug/rl``, char-target) for
``teacher_steps`` steps; its final weights folder is served by a second server. Then runs of the debug configs from
the tiny model's base weights alternate between RL alone (the environment's reward, GRPO) and on-policy distillation
from that teacher (``algorithm = "opd"``: each sampled token's advantage is the teacher's logprob minus the
student's). Both sides report the environment's reward per step,
which OPD never trains on: the question is whether the teacher's per-token signal moves the student's reward faster
than the reward itself does. The teacher's own reward (its evaluation's) is the ceiling.
"""

import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import common

from contracts.run_dir import weights_dir

TINY = "trident/tiny-qwen3"


@dataclass(frozen=True)
class BenchmarkConfig:
    teacher_steps: int  # the teacher's debug run
    steps: int  # each student run's steps
    batch_size: int  # prompts per step (the debug configs' 8 rollouts each)
    settings: tuple[str, ...]  # "rl" or "opd", one student run per entry, in this order
    window: int  # steps averaged at the start and the end of a run for its reward gain


FULL = BenchmarkConfig(teacher_steps=40, steps=20, batch_size=8, settings=("rl", "opd", "opd", "rl"), window=5)
SMOKE = BenchmarkConfig(teacher_steps=2, steps=2, batch_size=2, settings=("rl", "opd"), window=1)


def debug_flags(bench: BenchmarkConfig, steps: int, server_url: str) -> list[str]:
    """``rl``'s flags for the debug configs against the server at ``server_url``, ``steps`` steps."""
    configs = common.DEBUG_CONFIGS
    return ["--trainer", "@", str(configs / "train.toml"), "--orchestrator", "@", str(configs / "orch.toml"),
            "--max-steps", str(steps), "--orchestrator.batch-size", str(bench.batch_size),
            "--orchestrator.client.base-url", server_url, "--orchestrator.sample-rollouts-every", "0"]  # fmt: skip


def train_teacher(bench: BenchmarkConfig, server_url: str, output_dir: Path) -> tuple[Path, dict]:
    """The debug run for ``teacher_steps`` steps; its final weights folder (a model a server can serve) and its
    summary (:func:`common.rl_debug_run`)."""
    try:
        summary = common.rl_debug_run(debug_flags(bench, bench.teacher_steps, server_url), output_dir, 1800)
    finally:
        common.serve_base_model(server_url)
    return weights_dir(output_dir, bench.teacher_steps), summary


def student_run(bench: BenchmarkConfig, setting: str, server_url: str, teacher: tuple[str, str], folder: Path) -> dict:
    """One student run from the base weights: RL alone (``setting`` "rl") or distilling from ``teacher`` (its server's
    URL and model name)."""
    teacher_url, teacher_model = teacher
    opd = ["--orchestrator.algorithm", "opd", "--orchestrator.teacher.base-url", f"{teacher_url}/v1",
           "--orchestrator.teacher.model", teacher_model]  # fmt: skip
    flags = debug_flags(bench, bench.steps, server_url) + (opd if setting == "opd" else [])
    try:
        summary = common.rl_debug_run(flags, folder, 1800)
    finally:
        common.serve_base_model(server_url)
    rewards = summary["rewards"]
    return {
        "setting": setting,
        "rewards": rewards,
        "reward_gain": statistics.fmean(rewards[-bench.window :]) - statistics.fmean(rewards[: bench.window]),
        "reward_mean": statistics.fmean(rewards),
        "eval_reward_mean": summary["eval_reward_mean"],
        "seconds_per_step": summary["step_s_median"],
    }


def compare(runs: list[dict]) -> dict:
    """Per setting: each step's reward averaged over its runs, and the mean, lowest and highest over its runs of the
    reward gain and of the mean reward over all steps; the OPD side's mean reward minus RL's."""
    sides = {}
    for setting in ("rl", "opd"):
        mine = [run for run in runs if run["setting"] == setting]
        sides[setting] = {
            "runs": len(mine),
            "reward_per_step": [statistics.fmean(step) for step in zip(*(run["rewards"] for run in mine), strict=True)],
            **{key: {"mean": statistics.fmean(r[key] for r in mine), "min": min(r[key] for r in mine),
                     "max": max(r[key] for r in mine)} for key in ("reward_gain", "reward_mean")},
        }  # fmt: skip
    gap = sides["opd"]["reward_mean"]["mean"] - sides["rl"]["reward_mean"]["mean"]
    return sides | {"opd_minus_rl_reward_mean": gap}


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    teacher = result["teacher"]
    rows = [f"teacher: {result['config']['teacher_steps']} steps, reward {teacher['first_5_mean']:.3f} (first 5) -> "
            f"{teacher['last_5_mean']:.3f} (last 5)",
            f"{'':5}{'runs':>5}{'reward mean (min-max)':>26}{'reward gain (min-max)':>26}"]  # fmt: skip
    for setting in ("rl", "opd"):
        side = result[setting]
        cells = [
            f"{side[k]['mean']:.3f} ({side[k]['min']:.3f}-{side[k]['max']:.3f})" for k in ("reward_mean", "reward_gain")
        ]
        rows.append(f"{setting:5}{side['runs']:>5}{cells[0]:>26}{cells[1]:>26}")
    rows.append(f"mean reward, opd - rl: {result['opd_minus_rl_reward_mean']:+.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = common.benchmark_parser(__doc__, "distill_vs_rl", "a 2-step teacher, 2-step runs", server=True)
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    work = tempfile.TemporaryDirectory(prefix="trident-bench-distill-", dir=args.work_dir)
    with common.exit_on_sigterm(), work as tmp:
        with common.server_for(args.server, None if args.server else TINY, None, Path(tmp)) as server_url:
            folder, teacher = train_teacher(bench, server_url, Path(tmp) / "teacher")
            print(f"teacher: reward {teacher['first_5_mean']:.3f} -> {teacher['last_5_mean']:.3f}", flush=True)
            with common.inference_process(str(folder), None, Path(tmp), Path(tmp)) as (teacher_url, _):
                served = (teacher_url, common.served_model(teacher_url)[0])
                runs = []
                for index, setting in enumerate(bench.settings):
                    runs.append(student_run(bench, setting, server_url, served, Path(tmp) / f"run_{index}"))
                    print(f"run {index}: {setting}: reward mean {runs[-1]['reward_mean']:.3f}", flush=True)
        result = common.benchmark_result("distill_vs_rl", config=asdict(bench), teacher=teacher, runs=runs,
                                         **compare(runs))  # fmt: skip
    return common.report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
