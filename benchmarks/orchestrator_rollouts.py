"""Benchmark: the orchestrator's CPU time per model turn and its rollouts/s with hundreds to thousands of multi-turn
rollouts in flight, against a bare aiohttp client loop sending the same requests to the same server.

``uv run --no-sync python benchmarks/orchestrator_rollouts.py`` (``--smoke``: a few rollouts; ``--workers 4,8``: the
worker counts to compare, on a machine with the cores).

The server is ``benchmarks/scripted_server.py`` in a process of its own, answering ``POST /inference/v1/generate``
at once: while the prompt holds fewer than ``tool_calls`` tool responses, a calculator call, then the answer. So
every rollout runs ``tool_calls + 1`` model turns, every call executed. Two sides, one after the other, each batch
starting ``in_flight`` rollouts at once:

- **trident**: gsm8k-calc's tasks through the orchestrator's rollout path (``load_env``, ``run_group``): the
  in-process harness, verifiers' interception endpoint and training client rendering each turn to token ids.
- **trident, N workers**: the same rollouts spread over N rollout worker processes (``rollout_workers``), the
  orchestrator's way past one core; their CPU time is counted with this process's.
- **bare**: a plain aiohttp loop, ``in_flight`` coroutines each sending one rollout's requests in turn: the very
  request bodies the trident side sent (recorded by the server), each reply's JSON parsed. The least a client in
  Python does for the same exchange.

CPU time is this process's (user + system, all threads; with workers, theirs too) over a batch, per model turn; the
server's is not in it. One untimed warm-up batch first; then, per size and repetition, a trident batch, one per worker
count, and a bare batch.
"""

import asyncio
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp
import verifiers.v1 as vf
from common import benchmark_parser, benchmark_result, report
from scripted_server import TOOL_RESPONSE
from transformers import AutoTokenizer

from contracts.inference_api import GENERATE
from contracts.model_path import TINY_MODEL_ID
from orchestrator.batching.rollout import Rollout
from orchestrator.config import EnvConfig, InfraConfig, OrchestratorConfig
from orchestrator.loop.gc_tuning import tune_gc
from orchestrator.loop.workers import RolloutWorkers
from orchestrator.loop.workers import cpu_seconds as process_cpu_seconds
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits
from orchestrator.verifiers_adapter.patches import install_patches
from tools.tiny_model import built_model_path

SERVER = Path(__file__).parent / "scripted_server.py"
ENV = "gsm8k-calc"


@dataclass(frozen=True)
class BenchmarkConfig:
    """The rollouts of one benchmark run."""

    in_flight: tuple[int, ...]  # rollouts per batch, all started at once (a batch per size)
    group_size: int  # rollouts per task
    tool_calls: int  # calculator calls per rollout before the answer
    repetitions: int  # timed batches per side and size
    workers: tuple[int, ...]  # rollout worker counts, a trident side each

    @property
    def sides(self) -> tuple[str, ...]:
        return ("trident", *map(workers_side, self.workers), "bare")


def workers_side(count: int) -> str:
    return f"trident, {count} worker" + ("s" if count > 1 else "")


FULL = BenchmarkConfig(in_flight=(512, 2048), group_size=8, tool_calls=7, repetitions=2, workers=(2,))
SMOKE = BenchmarkConfig(in_flight=(4,), group_size=2, tool_calls=1, repetitions=1, workers=(1,))


@contextmanager
def scripted_server(tool_calls: int) -> Iterator[str]:
    """The base URL of a ``scripted_server.py`` process, for the duration of the block."""
    server = subprocess.Popen([sys.executable, str(SERVER), "--tool-calls", str(tool_calls)], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        line = server.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"the scripted server did not start (exit status {server.wait()})")
        yield f"http://127.0.0.1:{line.split()[1]}"
    finally:
        server.terminate()
        server.wait()


def cpu_seconds(pids: list[int] = ()) -> float:
    """User and system CPU seconds so far of this process and of the processes ``pids`` (Linux), all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime + sum(map(process_cpu_seconds, pids))


async def trident_batch(env: vf.Env, tasks: list, ctx: vf.ModelContext, bench: BenchmarkConfig) -> list[Rollout]:
    """``group_size`` rollouts of each task, all in flight at once."""
    limits = RolloutLimits.of(len(tasks) * bench.group_size)
    groups = await asyncio.gather(*(run_group(env, task, bench.group_size, ctx, limits) for task in tasks))
    return [rollout for group in groups for rollout in group]


async def workers_batch(workers: RolloutWorkers, tasks: list, ctx: vf.ModelContext, bench: BenchmarkConfig) -> list:
    """As :func:`trident_batch`, the groups run by ``workers``."""
    config = EnvConfig(id=ENV, args={"max_turns": bench.tool_calls + 1})
    client = ctx.client
    run = [workers.run_group(config, task, bench.group_size, client.base_url, ctx.model, client.api_key_var)
           for task in tasks]  # fmt: skip
    return [rollout for group in await asyncio.gather(*run) for rollout in group]


def rollout_requests(bodies: list[dict], tool_response_id: int, turns: int) -> list[list[dict]]:
    """The recorded request bodies of a batch regrouped as rollouts that ran all ``turns`` turns: a rollout's turn
    k prompt holds k tool responses (the server is stateless: which rollout's body goes in which sequence does not
    matter)."""
    by_turn: list[list[dict]] = [[] for _ in range(turns)]
    for body in bodies:
        by_turn[body["token_ids"].count(tool_response_id)].append(body)
    return [list(rollout) for rollout in zip(*by_turn, strict=False)]


async def bare_batch(base_url: str, rollouts: list[list[dict]]) -> int:
    """Send each rollout's requests in turn, all rollouts at once, parsing each reply; returns the sampled tokens."""
    url = base_url + GENERATE

    async def rollout(http: aiohttp.ClientSession, bodies: list[dict]) -> int:
        tokens = 0
        for body in bodies:
            async with http.post(url, json=body) as response:
                response.raise_for_status()
                tokens += len((await response.json())["choices"][0]["token_ids"])
        return tokens

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(rollouts))) as http:
        return sum(await asyncio.gather(*(rollout(http, bodies) for bodies in rollouts)))


async def measured(batch, pids: list[int] = ()) -> tuple[dict, object]:
    """Wall and CPU seconds (this process's and ``pids``') of awaiting ``batch``, and its result."""
    wall, cpu = time.perf_counter(), cpu_seconds(pids)
    result = await batch
    return {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds(pids) - cpu}, result


async def record(base_url: str, http: aiohttp.ClientSession, on: bool) -> list[dict]:
    """Start keeping the server's request bodies (``on``), or stop and return them."""
    if on:
        (await http.post(base_url + "/record")).raise_for_status()
        return []
    async with http.get(base_url + "/recorded") as response:
        return await response.json()


def trident_summary(timing: dict, rollouts: list[Rollout], turns: int) -> dict:
    """What one trident batch cost and did: every rollout must succeed with ``turns`` turns."""
    return timing | {
        "rollouts": len(rollouts),
        "ok_share": sum(r.ok for r in rollouts) / len(rollouts),
        "turns_mean": statistics.mean(r.turns for r in rollouts),
        "rewards_mean": {
            name: statistics.mean(r.rewards.get(name, 0.0) for r in rollouts) for name in rollouts[0].rewards
        },
        "tokens_mean": statistics.mean(sum(len(b.token_ids) for b in r.branches) for r in rollouts),
        "first_error": next((r.error for r in rollouts if r.error), None),
        "cpu_ms_per_turn": 1000 * timing["cpu_s"] / (len(rollouts) * turns),
        "rollouts_per_s": len(rollouts) / timing["wall_s"],
    }


def bare_summary(timing: dict, rollouts: int, turns: int, sampled_tokens: int) -> dict:
    return timing | {
        "rollouts": rollouts,
        "sampled_tokens_mean": sampled_tokens / rollouts,
        "cpu_ms_per_turn": 1000 * timing["cpu_s"] / (rollouts * turns),
        "rollouts_per_s": rollouts / timing["wall_s"],
    }


async def run_sizes(env: vf.Env, ctx: vf.ModelContext, base_url: str, bench: BenchmarkConfig,
                    pools: dict[int, RolloutWorkers]) -> dict:  # fmt: skip
    """A warm-up batch per trident side, then per size and repetition a batch of each side; the batches' summaries
    by size."""
    turns = bench.tool_calls + 1
    tokenizer = AutoTokenizer.from_pretrained(built_model_path(TINY_MODEL_ID))
    tool_response_id = tokenizer.convert_tokens_to_ids(TOOL_RESPONSE)
    tasks = list(env.taskset.take(max(bench.in_flight) // bench.group_size))
    sizes: dict[str, dict] = {}
    async with env.serving(), aiohttp.ClientSession() as http:
        await trident_batch(env, tasks[:1], ctx, bench)
        for count, workers in pools.items():
            await workers_batch(workers, tasks[:1] * count, ctx, bench)  # a group each: every worker loads the env
        for _ in range(bench.repetitions):
            for in_flight in bench.in_flight:
                batch_tasks = tasks[: in_flight // bench.group_size]
                size = sizes.setdefault(str(in_flight), {side: [] for side in bench.sides})
                await record(base_url, http, on=True)
                timing, rollouts = await measured(trident_batch(env, batch_tasks, ctx, bench))
                requests = rollout_requests(await record(base_url, http, on=False), tool_response_id, turns)
                size["trident"].append(trident_summary(timing, rollouts, turns))
                for count, workers in pools.items():
                    timing, rollouts = await measured(workers_batch(workers, batch_tasks, ctx, bench), workers.pids)
                    size[workers_side(count)].append(trident_summary(timing, rollouts, turns))
                bare_timing, tokens = await measured(bare_batch(base_url, requests))
                size["bare"].append(bare_summary(bare_timing, len(requests), turns, tokens))
    return sizes


def size_summary(batches: dict[str, list[dict]]) -> dict:
    """Medians over one size's repetitions, and each trident side's rollouts/s over the bare loop's."""
    medians = {
        side: {key: statistics.median(b[key] for b in runs) for key in ("cpu_ms_per_turn", "rollouts_per_s")}
        for side, runs in batches.items()
    }
    bare = medians["bare"]["rollouts_per_s"]
    ratios = {side: median["rollouts_per_s"] / bare for side, median in medians.items() if side != "bare"}
    return {"batches": batches, "median": medians, "rollouts_per_s_over_bare": ratios}


def run_benchmark(bench: BenchmarkConfig) -> dict:
    """Both sides against one scripted server process; the results as a JSON-able dict."""
    model_path = built_model_path(TINY_MODEL_ID)
    env = load_env(EnvConfig(id=ENV, args={"max_turns": bench.tool_calls + 1}))
    tune_gc()  # as the orchestrator's main does once its environments are loaded
    with scripted_server(bench.tool_calls) as base_url:
        config = OrchestratorConfig(client={"base_url": base_url}, env=[{"id": ENV}],
                                    max_concurrent=max(bench.in_flight))  # fmt: skip

        async def run() -> dict:
            pools = {count: RolloutWorkers(count, config, InfraConfig(), model_path) for count in bench.workers}
            try:
                return await run_sizes(env, model_context(config, model_path), base_url, bench, pools)
            finally:
                await asyncio.gather(*(workers.close() for workers in pools.values()))

        sizes = asyncio.run(run())
    return benchmark_result(
        "orchestrator_rollouts",
        config=asdict(bench) | {"model": TINY_MODEL_ID, "env": ENV, "turns": bench.tool_calls + 1},
        in_flight={size: size_summary(batches) for size, batches in sizes.items()},
    )


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    rows = [f"{'in flight':>10} {'side':22}{'CPU ms/turn':>12}{'rollouts/s':>12}{'of bare':>9}"]
    for size, summary in result["in_flight"].items():
        for side, median in summary["median"].items():
            ratio = summary["rollouts_per_s_over_bare"].get(side)
            rows.append(f"{size:>10} {side:22}{median['cpu_ms_per_turn']:>12.2f}{median['rollouts_per_s']:>12.1f}"
                        + (f"{ratio:>9.2f}" if ratio is not None else ""))  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = benchmark_parser(__doc__, "orchestrator_rollouts", "a tiny run: one batch of 4 rollouts per side")
    counts = "rollout worker counts, a trident side each, e.g. 2,4,8 (default: 2; empty: none)"
    parser.add_argument("--workers", type=lambda text: tuple(int(n) for n in text.split(",") if n), help=counts)
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    if args.workers is not None:
        bench = replace(bench, workers=args.workers)
    install_patches()
    result = run_benchmark(bench)
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
