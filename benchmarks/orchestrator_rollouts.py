"""Benchmark: rollouts/s of the orchestrator's in-process harness against verifiers' stock subprocess harness, on
the same multi-turn tool environment and an instant server, side by side in one run.

``uv run --no-sync python benchmarks/orchestrator_rollouts.py`` (``--smoke``: a few rollouts).

Both sides run gsm8k-calc's tasks through the orchestrator's rollout path (``run_group`` on a loaded environment,
verifiers' training client rendering each turn to token ids) against a scripted server in this process that
answers at once: a rollout's first ``tool_calls`` replies call the calculator, the next one answers, so every
rollout runs the tool loop for real (``tool_calls + 1`` model turns, every call executed). Only the harness
differs:

- **trident**: ``gsm8k-calc`` loaded as the orchestrator loads it (``load_env``): the in-process harness of
  ``orchestrator.harness``, the calculator a Python call.
- **stock**: verifiers 0.4.0's ``null`` harness, its chat program run as one Python subprocess per rollout by
  the subprocess runtime, on ``gsm8k-calc-stock`` (``benchmarks/gsm8k_calc_stock.py``: the same tasks and
  rewards, the calculator served by one MCP server that all rollouts share).

Batches of rollouts (``tasks`` tasks × ``group_size`` rollouts, at most ``concurrency`` in flight) alternate
between the sides, order swapped every repetition, after one untimed warm-up batch each: the stock harness's
first rollout builds its program's environment with ``uv sync --script``, which needs ``uv`` and, until uv's
cache holds the packages, PyPI. Only the ratio means something on a shared, noisy machine.
"""

import asyncio
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import verifiers.v1 as vf
from common import benchmark_result, run_and_report
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.envs import Rollout, load_env, model_context, run_group
from orchestrator.limits import RolloutLimits
from rl.inference_api import GENERATE, MODELS
from rl.model_path import TINY_MODEL_ID, resolve_model_path

BENCHMARKS = Path(__file__).parent
SIDES = ("trident", "stock")
STOCK_HARNESS = "null"  # verifiers' plain chat loop; MCP tools, no bash
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(12 + 8) * 3"}}\n</tool_call><|im_end|>'
ANSWER = "(12 + 8) * 3 = 60\n#### 60<|im_end|>"
LOGPROB = -1.0  # of every scripted token


@dataclass(frozen=True)
class BenchmarkConfig:
    """The rollouts of one benchmark run."""

    tasks: int  # tasks per batch
    group_size: int  # rollouts per task
    concurrency: int  # rollouts in flight at once, per side
    tool_calls: int  # calculator calls per rollout before the answer
    repetitions: int  # timed batches per side, after one warm-up batch each


FULL = BenchmarkConfig(tasks=2, group_size=8, concurrency=8, tool_calls=2, repetitions=3)
SMOKE = BenchmarkConfig(tasks=1, group_size=2, concurrency=2, tool_calls=1, repetitions=1)


def generate_response(token_ids: list[int]) -> bytes:
    """The body of vLLM's ``/inference/v1/generate`` answer sampling ``token_ids``, each with logprob -1."""
    logprobs = [{"token": f"token_id:{token}", "logprob": LOGPROB} for token in token_ids]
    choice = {"index": 0, "token_ids": token_ids, "logprobs": {"content": logprobs}, "finish_reason": "stop"}
    return json.dumps({"request_id": "scripted", "choices": [choice]}).encode()


class ScriptedServer(ThreadingHTTPServer):
    """A token-in/token-out inference server that answers at once from a script: while the prompt holds fewer
    than ``tool_calls`` tool responses, a calculator call; then a final answer. Serves ``POST
    /inference/v1/generate`` (what verifiers' training client calls) and ``GET /v1/models``."""

    daemon_threads = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tool_calls: int):
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.tool_calls = tool_calls
        self.tool_response_id = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.call = generate_response(tokenizer.encode(TOOL_CALL, add_special_tokens=False))
        self.answer = generate_response(tokenizer.encode(ANSWER, add_special_tokens=False))
        self.models = json.dumps({"object": "list", "data": [{"id": TINY_MODEL_ID, "object": "model"}]}).encode()
        self.requests = 0

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def reply(self, prompt_ids: list[int]) -> bytes:
        self.requests += 1
        return self.call if prompt_ids.count(self.tool_response_id) < self.tool_calls else self.answer


class ScriptedHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive, no request logging."""

    protocol_version = "HTTP/1.1"
    server: ScriptedServer

    def do_GET(self) -> None:
        if self.path == MODELS:
            self.respond(200, self.server.models)
        else:
            self.respond(404, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != GENERATE:
            self.respond(404, b"{}")
            return
        self.respond(200, self.server.reply(body["token_ids"]))

    def respond(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        pass


@contextmanager
def scripted_server(tokenizer: PreTrainedTokenizerBase, tool_calls: int) -> Iterator[ScriptedServer]:
    """A :class:`ScriptedServer` answering from a thread of this process for the duration of the block."""
    server = ScriptedServer(tokenizer, tool_calls)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def importable_by_subprocesses(folder: Path) -> Iterator[None]:
    """``folder`` on ``PYTHONPATH`` for the block: verifiers starts the stock taskset's tool server as
    ``python -m gsm8k_calc_stock``."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), before) if p)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def load_envs() -> dict[str, vf.Env]:
    """gsm8k-calc as the orchestrator loads it, and its MCP twin under verifiers' stock harness."""
    stock = vf.SingleAgentEnvConfig(
        taskset={"id": "gsm8k-calc-stock"},
        agent=vf.AgentConfig(harness={"id": STOCK_HARNESS}, runtime=vf.SubprocessConfig()),
    )
    return {"trident": load_env(EnvConfig(id="gsm8k-calc")), "stock": vf.load_environment(stock)}


async def timed_batch(
    env: vf.Env, tasks: list, ctx: vf.ModelContext, bench: BenchmarkConfig
) -> tuple[float, list[Rollout]]:
    """Seconds to run ``group_size`` rollouts of each task, at most ``concurrency`` at once, and the rollouts."""
    limit = RolloutLimits.of(bench.concurrency)
    start = time.perf_counter()
    groups = await asyncio.gather(*(run_group(env, task, bench.group_size, ctx, limit) for task in tasks))
    return time.perf_counter() - start, [rollout for group in groups for rollout in group]


async def alternate(
    envs: dict[str, vf.Env], ctx: vf.ModelContext, bench: BenchmarkConfig
) -> tuple[dict[str, list[float]], dict[str, list[Rollout]]]:
    """One warm-up batch per side, then ``repetitions`` timed batches per side, alternating (order swapped every
    repetition); the seconds of the timed batches and all their rollouts, per side."""
    side_tasks = {name: list(env.taskset.take(bench.tasks)) for name, env in envs.items()}
    prompts = {name: [task.data.prompt for task in tasks] for name, tasks in side_tasks.items()}
    assert prompts["trident"] == prompts["stock"], "the two sides must run the same tasks"
    seconds: dict[str, list[float]] = {name: [] for name in SIDES}
    rollouts: dict[str, list[Rollout]] = {name: [] for name in SIDES}
    async with AsyncExitStack() as stack:
        for env in envs.values():
            await stack.enter_async_context(env.serving())
        for name in SIDES:
            await timed_batch(envs[name], side_tasks[name], ctx, bench)
        for repetition in range(bench.repetitions):
            for name in SIDES if repetition % 2 == 0 else reversed(SIDES):
                took, batch = await timed_batch(envs[name], side_tasks[name], ctx, bench)
                seconds[name].append(took)
                rollouts[name] += batch
    return seconds, rollouts


def side_summary(seconds: list[float], rollouts: list[Rollout], per_batch: int) -> dict:
    """Rollouts/s of one side, and what its rollouts did: all must succeed with the same turns and rewards."""
    return {
        "batch_seconds": seconds,
        "rollouts_per_s": per_batch / statistics.median(seconds),
        "rollouts": len(rollouts),
        "ok_share": sum(r.ok for r in rollouts) / len(rollouts),
        "turns_mean": statistics.mean(r.turns for r in rollouts),
        "reward_mean": statistics.mean(r.reward for r in rollouts),
        "rewards_mean": {
            name: statistics.mean(r.rewards.get(name, 0.0) for r in rollouts) for name in rollouts[0].rewards
        },
        "tokens_mean": statistics.mean(sum(len(ids) for ids, _, _ in r.branches) for r in rollouts),
        "first_error": next((r.error for r in rollouts if r.error), None),
    }


def speed_ratio(seconds: dict[str, list[float]]) -> dict:
    """Trident's rollouts/s over the stock harness's: the ratio of the median batch times, and the median of the
    ratios of each repetition's two adjacent batches."""
    paired = [stock / trident for trident, stock in zip(seconds["trident"], seconds["stock"], strict=True)]
    return {
        "of_medians": statistics.median(seconds["stock"]) / statistics.median(seconds["trident"]),
        "paired_median": statistics.median(paired),
        "paired": paired,
    }


def run_benchmark(bench: BenchmarkConfig) -> dict:
    """Both sides against one scripted server, side by side; the results as a JSON-able dict."""
    model_path = resolve_model_path(TINY_MODEL_ID)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with scripted_server(tokenizer, bench.tool_calls) as server, importable_by_subprocesses(BENCHMARKS):
        config = OrchestratorConfig(client={"base_url": server.base_url}, env=[{"id": "gsm8k-calc"}])
        seconds, rollouts = asyncio.run(alternate(load_envs(), model_context(config, model_path), bench))
        requests = server.requests
    per_batch = bench.tasks * bench.group_size
    sides = {name: side_summary(seconds[name], rollouts[name], per_batch) for name in SIDES}
    return benchmark_result(
        "orchestrator_rollouts",
        config=asdict(bench)
        | {
            "model": TINY_MODEL_ID,
            "env": "gsm8k-calc",
            "stock_harness": STOCK_HARNESS,
            "rollouts_per_batch": per_batch,
        },
        **sides,
        server_requests=requests,
        trident_over_stock_rollouts_per_s=speed_ratio(seconds),
        same_outcome=all(
            sides["trident"][key] == sides["stock"][key] for key in ("ok_share", "turns_mean", "reward_mean")
        ),
    )


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    rows = [f"{'':8}{'rollouts/s':>12}{'ok':>6}{'turns':>7}{'reward':>8}{'tokens':>8}"]
    for name in SIDES:
        s = result[name]
        rows.append(
            f"{name:8}{s['rollouts_per_s']:>12.2f}{s['ok_share']:>6.0%}{s['turns_mean']:>7.1f}"
            f"{s['reward_mean']:>8.3f}{s['tokens_mean']:>8.0f}"
        )
    ratio = result["trident_over_stock_rollouts_per_s"]
    rows += [
        f"trident / stock rollouts/s: {ratio['of_medians']:.1f} "
        f"(median of paired batches: {ratio['paired_median']:.1f})",
        f"same turns and rewards on both sides: {result['same_outcome']}",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    return run_and_report(
        argv, __doc__, "orchestrator_rollouts", "a tiny run: one batch of 2 rollouts per side",
        lambda smoke: run_benchmark(SMOKE if smoke else FULL), summary_table,
    )  # fmt: skip


if __name__ == "__main__":
    main()
