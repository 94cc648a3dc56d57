"""Benchmark: how long the inference server takes to switch to new weights, full weights against a LoRA
adapter, side by side against one server.

``uv run --no-sync python benchmarks/reload_latency.py`` (``--smoke`` for a short run on the tiny model;
``--server URL`` to measure a running server, which must serve LoRA adapters of rank 8, instead of starting one
per model).

For each model (the tiny model, and a larger random Qwen3 of the same vocabulary, where loading full weights
costs more), one server serves it and gets ``reloads`` full-weight reloads (``POST /reload_weights``) and as
many adapter loads (``POST /load_adapter``), interleaved in the order full, LoRA, LoRA, full, ... after one
untimed warm-up of each. Full-weight folders are copies of the served model's own folder (HF format, as the
trainer writes them), so the server's base weights end as they started; loading costs the same whatever the
values. Adapters are peft adapters of rank 8 on the attention projections (the trainer's defaults) with random
weights. Afterwards the server serves its base weights and no adapter. The server is otherwise idle: a full
reload also waits for requests in flight, an adapter load does not.

Reported per kind: the server's own seconds (the route's ``seconds``: from taking the weights lock to serving the
new weights) and the client's round trip, their median and maximum, and the ratio full / LoRA of the medians.
"""

import itertools
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
import transformers
from common import (
    benchmark_model,
    benchmark_parser,
    copy_weights,
    exit_on_sigterm,
    machine_info,
    model_summary,
    report,
    serve_base_model,
    served_model,
    server_for,
    utc_now,
)
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.protocol import auth_headers, mark_stable

LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the trainer's default target modules
KINDS = {"full": "/reload_weights", "lora": "/load_adapter"}
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class BenchmarkConfig:
    """The models measured (name: overrides of the tiny model's config; empty: the tiny model itself) and the
    number of timed reloads of each kind per model."""

    models: dict[str, dict[str, int]]
    reloads: int


LARGER = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
FULL = BenchmarkConfig(models={"tiny": {}, "larger": LARGER}, reloads=10)
SMOKE = BenchmarkConfig(models={"tiny": {}}, reloads=2)


def write_adapter(model_folder: Path, folder: Path, seed: int) -> Path:
    """A peft adapter for the model in ``model_folder`` with random, non-zero weights, marked ``STABLE``."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_folder).save_pretrained(folder)  # as the trainer writes adapters
    mark_stable(folder)
    return folder


def adapter_bytes(folder: Path) -> int:
    """Size of an adapter's weight files."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def reload(http: httpx.Client, kind: str, folder: Path, step: int) -> tuple[float, float]:
    """Ask the server to load ``folder`` as weights ``step``; returns (server seconds, client round trip)."""
    start = time.perf_counter()
    response = http.post(KINDS[kind], json={"path": str(folder.resolve()), "step": step})
    round_trip = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{KINDS[kind]} {folder}: {response.status_code} {response.text}")
    return response.json()["seconds"], round_trip


def interleaved(reloads: int) -> list[str]:
    """The kinds of the timed reloads: full, lora, lora, full, ... so that drift in the machine's load hits both."""
    order = []
    for repetition in range(reloads):
        order += list(KINDS) if repetition % 2 == 0 else list(reversed(KINDS))
    return order


def stats(server_s: list[float], round_trip_s: list[float]) -> dict:
    """Median and maximum of one kind's timings."""
    return {
        "server_s": server_s,
        "round_trip_s": round_trip_s,
        "server_median_s": statistics.median(server_s),
        "server_max_s": max(server_s),
        "round_trip_median_s": statistics.median(round_trip_s),
        "round_trip_max_s": max(round_trip_s),
    }


def measure(server_url: str, reloads: int, work_dir: Path) -> dict:
    """Interleaved full and LoRA reloads against the server; timings of each kind and their ratio."""
    model_folder = served_model(server_url)[1]
    serve_base_model(server_url)  # adapter names start again at step 1: none of an earlier user's may be served
    adapters = [write_adapter(model_folder, work_dir / f"lora_{i}", seed=i) for i in range(2)]
    folders = {"full": [copy_weights(model_folder, work_dir / f"full_{i}") for i in range(2)], "lora": adapters}
    next_folder = {kind: itertools.cycle(folders[kind]) for kind in KINDS}  # two of each kind, in turn
    timings: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    warm_ups = list(KINDS)
    with httpx.Client(base_url=server_url, timeout=REQUEST_TIMEOUT_S, headers=auth_headers()) as http:
        for step, kind in enumerate([*warm_ups, *interleaved(reloads)], start=1):  # a new adapter name per step
            seconds = reload(http, kind, next(next_folder[kind]), step)
            if step > len(warm_ups):
                timings[kind].append(seconds)
    serve_base_model(server_url)  # retire the last adapter
    kinds = {kind: stats(*zip(*timings[kind], strict=True)) for kind in KINDS}
    return {
        "model": model_summary(model_folder) | {"adapter_bytes": adapter_bytes(adapters[0])},
        **kinds,
        "full_over_lora_server": kinds["full"]["server_median_s"] / kinds["lora"]["server_median_s"],
        "full_over_lora_round_trip": kinds["full"]["round_trip_median_s"] / kinds["lora"]["round_trip_median_s"],
    }


def measure_model(shape: dict[str, int], server: str | None, reloads: int, work_dir: Path) -> dict:
    """Serve the tiny model reshaped by ``shape`` (or use ``server``) and measure its reloads."""
    with server_for(server, benchmark_model(shape, work_dir / "model"), LORA_RANK) as server_url:
        return measure(server_url, reloads, work_dir)


def run_benchmark(bench: BenchmarkConfig, server: str | None, work_dir: Path) -> dict:
    """Each model of ``bench`` in turn (only the served one with ``server``); the results as a JSON-able dict."""
    models = {"served": {}} if server else bench.models
    results = {}
    for name, shape in models.items():
        (work_dir / name).mkdir()
        results[name] = measure_model(shape, server, bench.reloads, work_dir / name)
    return {
        "benchmark": "reload_latency",
        "date": utc_now(),
        "machine": machine_info(),
        "config": asdict(bench) | {"lora_rank": LORA_RANK, "lora_targets": LORA_TARGETS, "server": server},
        "models": results,
    }


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    rows = [f"{'model':8}{'kind':6}{'MB':>9}{'server med':>12}{'max':>8}{'round trip':>12}{'max':>8}"]
    for name, model in result["models"].items():
        for kind in KINDS:
            size = model["model"]["weights_bytes"] if kind == "full" else model["model"]["adapter_bytes"]
            s = model[kind]
            rows.append(
                f"{name:8}{kind:6}{size / 1e6:>9.3f}{s['server_median_s']:>12.4f}{s['server_max_s']:>8.4f}"
                f"{s['round_trip_median_s']:>12.4f}{s['round_trip_max_s']:>8.4f}"
            )
        rows.append(
            f"{name:8}full / lora: server {model['full_over_lora_server']:.2f}, "
            f"round trip {model['full_over_lora_round_trip']:.2f}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = benchmark_parser(__doc__, "reload_latency", "a short run: 2 reloads of each kind, tiny model", server=True)
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    transformers.utils.logging.disable_progress_bar()
    with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="trident-bench-reload-") as tmp:
        result = run_benchmark(bench, args.server, Path(tmp))
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
