"""What the benchmarks share: the machine they ran on, random models larger than the tiny one, an inference
server to run against, training runs alternating between two settings, and writing their results."""

import argparse
import importlib.metadata
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch
from safetensors import safe_open

from contracts.inference_api import HEALTH, MODELS, RESET_WEIGHTS, auth_headers
from contracts.metrics import read_metrics
from contracts.model_path import TINY_MODEL_ID
from launch.process import Child, stop_all
from launch.supervise import child_env, log_tail
from tools.tiny_model import built_model_path

RESULTS_DIR = Path(__file__).parent / "results"
DEBUG_CONFIGS = Path(__file__).parents[1] / "configs" / "debug" / "rl"
RUN_TIMEOUT_S = 1800.0  # one training run of trainer and orchestrator
ORCHESTRATOR_PHASES = ("wait_weights_s", "reload_s", "generate_s", "write_s")  # of a step, in its metrics
TRAINER_PHASES = ("wait_s", "train_s", "save_s")  # of a step: together the trainer's step time
SERVER_TIMEOUT_S = 900.0  # vLLM starts in about a minute on a quiet 2-core machine, several on a loaded one


def cpu_model() -> str:
    """The CPU's marketing name (Linux), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """What the numbers were measured on, including how loaded the machine was when the run ended."""
    return {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the widest vector ops torch uses: AVX2, AVX512
        "cores": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
    }


def rss_mib(key: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak_rss() -> float:
    """Reset this process's peak resident memory to what it holds now (Linux); returns that, in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_mib("VmRSS")


def utc_now() -> str:
    """The date and time of a run, ISO 8601 in UTC."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def benchmark_result(name: str, **fields) -> dict:
    """A benchmark's results: its name, when and on what machine it ran, then ``fields``."""
    return {"benchmark": name, "date": utc_now(), "machine": machine_info(), **fields}


def benchmark_parser(doc: str, name: str, smoke_help: str, server: bool = False) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--smoke``, ``--output`` (default ``results/<name>.json``) and, for one
    that runs against an inference server, ``--server``. ``doc``: the script's docstring."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / f"{name}.json", help="where the JSON results go")
    if server:
        parser.add_argument("--server", help="URL of a running inference server to use instead of starting one")
        parser.add_argument("--work-dir", type=Path, help="where runs write (with --server: under its weights_root)")
    return parser


def report(output: Path, result: dict, table: str) -> dict:
    """Write a benchmark's results as indented JSON to ``output`` (creating the folder), print its summary table;
    returns the results."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(table)
    print(f"results: {output}")
    return result


def run_and_report(
    argv: list[str] | None, doc: str, name: str, smoke_help: str, run: Callable[[bool], dict], table: Callable
) -> dict:
    """The ``main`` of a benchmark with no flags of its own: ``run(smoke)``, write its result to ``--output`` and
    print ``table(result)``; returns the result."""
    args = benchmark_parser(doc, name, smoke_help).parse_args(argv)
    result = run(args.smoke)
    return report(args.output, result, table(result))


def build_random_model(folder: Path, shape: dict[str, int], seed: int = 0, tiny_model: str = TINY_MODEL_ID) -> Path:
    """Save a random model with a tiny model's config and tokenizer (the tiny Qwen3 unless ``tiny_model`` names
    another), reshaped by ``shape``: a model the inference server can serve and the trainer can train."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # here: a benchmark's child processes
    # import this module, and most never build a model (transformers takes seconds to import)

    tiny = built_model_path(tiny_model)
    config = AutoConfig.from_pretrained(tiny)
    for name, value in shape.items():
        setattr(config, name, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    return folder


def benchmark_model(shape: dict[str, int], folder: Path) -> str:
    """The model a benchmark runs: the tiny model (built if it is not yet) for an empty ``shape``, else one built into
    ``folder``."""
    if shape:
        return str(build_random_model(folder, shape))
    built_model_path(TINY_MODEL_ID)
    return TINY_MODEL_ID


def model_summary(model_folder: Path) -> dict:
    """A model's shape, parameter count and the size of its weight files."""
    from transformers import AutoConfig  # here: see build_random_model

    config = AutoConfig.from_pretrained(model_folder)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")  # fmt: skip
    files = list(Path(model_folder).glob("*.safetensors"))
    parameters = 0
    for file in files:
        with safe_open(file, "pt") as tensors:
            parameters += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return {key: getattr(config, key) for key in keys} | {
        "parameters": parameters,
        "weights_bytes": sum(f.stat().st_size for f in files),
    }


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM exits through ``SystemExit`` (so ``finally`` blocks stop the processes a
    benchmark started) instead of killing the interpreter on the spot."""

    def exit_now(signum, frame):
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cpu_s(stat_fields: list[str]) -> float:
    """User + system CPU seconds from the fields of a ``/proc/<pid>/stat`` after the command's name."""
    return (int(stat_fields[11]) + int(stat_fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process ``pid``, its threads included (``/proc``)."""
    return _cpu_s(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())


def process_group_cpu_s(groups: list[int]) -> float:
    """CPU seconds used so far by the live processes of the process groups ``groups`` (``/proc``)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups:
            total += _cpu_s(fields)
    return total


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, server: Child, timeout_s: float = SERVER_TIMEOUT_S) -> None:
    """Poll ``/health`` until the server answers 200; raise if it exits or takes longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the inference server exited with code {server.poll()}; log: {server.log_path}")
        try:
            if httpx.get(f"{base_url}{HEALTH}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the inference server was not healthy after {timeout_s:.0f}s; log: {server.log_path}")


@contextmanager
def inference_process(
    model: str,
    lora_rank: int | None,
    log_dir: Path,
    weights_root: Path,
    max_model_len: int = 1024,
    env: dict[str, str] | None = None,
    broadcast_port: int | None = None,
    max_loras: int = 2,
) -> Iterator[tuple[str, Child]]:
    """Start ``inference`` serving ``model`` (a name or a folder) with LoRA adapters up to ``lora_rank`` (None: no
    adapters), ``max_loras`` of them in one batch (``env``: more environment variables), loading weights from the
    step folders under ``weights_root`` (and in-memory weights through a trainer's store on ``broadcast_port``);
    yield its base URL and process once healthy, and stop it (its whole process group) on exit."""
    built_model_path(model)  # a tiny model is built first
    port = free_port()
    config = log_dir / "infer.toml"
    lora = f"[lora]\nmax_rank = {lora_rank}\nmax_loras = {max_loras}\n" if lora_rank is not None else ""
    broadcast = f"[weight_broadcast]\nport = {broadcast_port}\n" if broadcast_port else ""
    config.write_text(
        f'port = {port}\nweights_root = {str(weights_root)!r}\n[model]\nname = "{model}"\nenforce_eager = true\n'
        f"max_model_len = {max_model_len}\n{lora}{broadcast}"
    )
    argv = [sys.executable, "-m", "inference.main", "@", str(config)]
    server = Child("inference", argv, log_dir / "inference.log", child_env(env or {}))
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, server)
        yield base_url, server
    finally:
        stop_all([server])


@contextmanager
def server_for(
    url: str | None,
    model: str | None,
    lora_rank: int | None,
    weights_root: Path,
    max_model_len: int = 1024,
    broadcast_port: int | None = None,
) -> Iterator[str]:
    """The server at ``url`` when given (it must serve LoRA adapters of ``lora_rank`` and load weights from under
    ``weights_root``), else one started for the duration of the block to serve ``model`` (adapters up to
    ``lora_rank``; None: none) from ``weights_root`` (and ``broadcast_port``), with its log in a temporary folder."""
    if url is not None:
        yield url.rstrip("/")
        return
    with tempfile.TemporaryDirectory(prefix="trident-bench-server-") as tmp:
        started = inference_process(model, lora_rank, Path(tmp), weights_root, max_model_len, None, broadcast_port)
        with started as (base_url, _):
            yield base_url


def wait_all(children: list[Child], timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Wait until every child has exited with 0; raise naming the first that fails, after stopping them all."""
    deadline = time.monotonic() + timeout_s
    try:
        while not all(child.poll() == 0 for child in children):
            failed = next((child for child in children if child.poll() not in (None, 0)), None)
            if failed is not None:
                raise RuntimeError(f"{failed.name} exited with code {failed.poll()}:\n{log_tail(failed.log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the run did not finish within {timeout_s:.0f}s; logs: {children[0].log_path.parent}"
                )
            time.sleep(0.5)
    finally:
        stop_all(children)


def served_model(base_url: str) -> tuple[str, Path]:
    """The name and the folder of the base model a server serves (the first model in ``/v1/models``)."""
    response = httpx.get(f"{base_url}{MODELS}", headers=auth_headers(), timeout=30)
    response.raise_for_status()
    model = response.json()["data"][0]
    return model["id"], Path(model["root"])


def serve_base_model(base_url: str) -> None:
    """Make the server serve its base model's own weights again, and no adapter (as when it started)."""
    response = httpx.post(f"{base_url}{RESET_WEIGHTS}", headers=auth_headers(), timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"resetting the server to its base model: {response.status_code} {response.text}")


def placed_env() -> dict[str, str]:
    """The environment ``rl`` gives a trainer or orchestrator on this machine (:func:`launch.supervise.child_env`,
    with no GPU visible on a machine without one), so that a preloaded starter named in ``$TRIDENT_PRELOADED`` (the
    test suite's) forks it, as it does ``rl``'s."""
    return child_env({} if torch.cuda.is_available() else {"CUDA_VISIBLE_DEVICES": ""})


def train_run(trainer: list[str], orchestrator: list[str], output_dir: Path, server_url: str) -> None:
    """Run a trainer and an orchestrator (their argv) to the end, their logs in ``output_dir/logs/``; then the server
    serves its base model again (no adapter), as a fresh server would: the next run starts from the same state."""
    logs = output_dir / "logs"
    children = [Child(name, argv, logs / f"{name}.log", placed_env())
                for name, argv in (("trainer", trainer), ("orchestrator", orchestrator))]  # fmt: skip
    try:
        wait_all(children)
    finally:
        serve_base_model(server_url)


def alternating_runs(
    name: str,
    config: dict,
    key: str,
    settings: Sequence,
    server_url: str,
    work_dir: Path,
    run_once: Callable[[object, str, Path], dict],
    compare: Callable[[list[dict]], dict],
) -> dict:
    """A benchmark of training runs against the server, one per entry of ``settings`` in this order (alternating
    between two settings, so that drift in the machine's load hits both): ``run_once(setting, model, folder)`` runs
    one on ``model`` (the name the server serves its model under) and summarizes it, naming its setting under
    ``key`` and giving its ``seconds_per_step``. The result: ``config``, the served model, the runs and
    ``compare(runs)``."""
    model, model_folder = served_model(server_url)
    runs = []
    for index, setting in enumerate(settings):
        summary = run_once(setting, model, work_dir / f"run_{index}")
        print(f"run {index}: {key} {setting}: {summary['seconds_per_step']:.3f} s/step", flush=True)
        runs.append(summary)
    return benchmark_result(name, config=config, model=model_summary(model_folder), runs=runs, **compare(runs))


def pair_ratios(runs: list[dict], key: str, base: object, other: object) -> list[float]:
    """Step time of setting ``other`` over ``base`` (the runs' ``key``) in each pair of neighbouring runs (the first
    and second, the third and fourth, ...): the two runs of a pair ran at about the same machine load."""
    ratios = []
    for first, second in zip(runs[::2], runs[1::2], strict=False):
        seconds = {run[key]: run["seconds_per_step"] for run in (first, second)}
        if seconds.keys() == {base, other}:
            ratios.append(seconds[other] / seconds[base])
    return ratios


def rl_debug_run(flags: list[str], output_dir: Path, timeout_s: float) -> dict:
    """Run ``rl`` with ``flags`` (config files and flags of a debug run) into ``output_dir``; a failure raises with the
    tail of its stderr. What the run did: its reward per step and over its first and last 5 steps, its held-out
    evaluations, the probe gaps after the server's reloads, the trainer's largest mismatch KL and peak memory, and its
    median step. It draws no plots (what it measures is in its metrics)."""
    argv = [sys.executable, "-m", "launch.main", *flags, "--no-plots", "--output-dir", str(output_dir)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=Path(__file__).parents[1])
    if result.returncode != 0:
        raise RuntimeError(f"rl failed ({result.returncode}): {result.stderr[-3000:]}")
    orchestrator, trainer = read_metrics(output_dir, "orchestrator"), read_metrics(output_dir, "trainer")
    rewards = [r["reward_mean"] for r in orchestrator]
    return {
        "rewards": rewards,
        "first_5_mean": statistics.mean(rewards[:5]),
        "last_5_mean": statistics.mean(rewards[-5:]),
        "eval_reward_mean": {e["step"]: e["eval/char-target/reward_mean"] for e in read_metrics(output_dir, "eval")},
        "probe_gaps": [r["probe_gap"] for r in orchestrator if r.get("probe_gap") is not None],
        "mismatch_kl_max": max(r["mismatch_kl"] for r in trainer),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in trainer),
        "step_s_median": statistics.median(r["wait_s"] + r["train_s"] + r["save_s"] for r in trainer[1:]),
    }
