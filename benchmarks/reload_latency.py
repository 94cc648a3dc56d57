"""Benchmark: how long the inference server takes to switch to new weights: full weights through files, full
weights through a shared-memory buffer (``[weight_broadcast] backend = "shared"``) and a LoRA adapter, side by side
against one server.

``uv run --no-sync python benchmarks/reload_latency.py`` (``--smoke`` for a short run on the tiny model;
``--server URL`` to measure a running server, which must serve LoRA adapters of rank 8, load weights from under
``--work-dir`` and take in-memory weights through ``--broadcast-port``, instead of starting one per model).

For each model (the tiny model, and a larger random Qwen3 of the same vocabulary, where loading full weights
costs more), one server serves it and gets ``reloads`` full-weight reloads from files (``POST /reload_weights``),
as many from the shared buffer (the same route on a folder holding the buffer's manifest) and as many adapter
loads (``POST /load_adapter``), interleaved in the order full, LoRA, shared, shared, LoRA, full, ... after one
untimed warm-up of each. Each folder is written just before, timed, by the trainer's own export
(``trainer.export.save_weights``) from the trainer's model of the served model, built as the trainer builds it
(a one-rank FSDP2 group): full training writes full weights (to files, or into the shared buffer with the
folder holding its manifest, after the server took the previous ones), LoRA training (rank 8 on the attention
projections, the trainer's defaults, ``export = "adapter"``) its adapter alone. Loading costs the same whatever
the values. Afterwards the server serves its base weights and no adapter. The server is otherwise idle: a full
reload also waits for requests in flight, an adapter load does not.

Reported per kind: the trainer's export seconds, the server's own seconds (the route's ``seconds``: from taking
the weights lock to serving the new weights), the client's round trip, and end to end (export + round trip),
their median and maximum, and the ratios full / LoRA and shared / full of the medians.
"""

import shutil
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
    benchmark_result,
    exit_on_sigterm,
    free_port,
    model_summary,
    report,
    serve_base_model,
    served_model,
    server_for,
)
from torch import nn
from transformers import AutoTokenizer

from contracts.inference_api import LOAD_ADAPTER, RELOAD_WEIGHTS, WeightsChange, WeightsRequest, auth_headers
from contracts.run_dir import is_adapter, step_dirs
from trainer.config import TrainerModelConfig
from trainer.export import save_weights
from trainer.parallel import World, close_world, init_world
from trainer.train import build_model
from trainer.transports import memory_sender
from trainer.transports.base import WeightSender

LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the trainer's default target modules
KINDS = {"full": RELOAD_WEIGHTS, "lora": LOAD_ADAPTER, "shared": RELOAD_WEIGHTS}
COMPARED = {"full_over_lora": ("full", "lora"), "shared_over_full": ("shared", "full")}  # ratios of the medians
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


TRAINER_MODELS = {  # the trainer's [model] section for each kind, beyond its name
    "full": {},
    "shared": {},
    "lora": {"experimental": {"lora": {"rank": LORA_RANK, "alpha": 2 * LORA_RANK, "target_modules": LORA_TARGETS,
                                       "export": "adapter"}}},
}  # fmt: skip


def trainer_model(model_folder: Path, kind: str, world: World) -> nn.Module:
    """The trainer's model of ``model_folder`` for ``kind`` (full or LoRA training), as the trainer builds it."""
    torch.manual_seed(0)
    config = TrainerModelConfig(name=str(model_folder), **TRAINER_MODELS[kind])
    return build_model(config, world, offload=False)


def export(model: nn.Module, tokenizer, kind: str, folder: Path, sender: WeightSender) -> float:
    """Write the weights of ``kind`` to ``folder`` with the trainer's export (through ``sender`` for the shared
    buffer); returns its seconds."""
    start = time.perf_counter()
    save_weights(
        model, tokenizer, folder, "adapter" if kind == "lora" else "merged", sender if kind == "shared" else None
    )
    return time.perf_counter() - start


def adapter_bytes(folder: Path) -> int:
    """Size of an adapter's weight files."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def reload(http: httpx.Client, kind: str, folder: Path, step: int) -> tuple[float, float]:
    """Ask the server to load ``folder`` as weights ``step``; returns (server seconds, client round trip)."""
    start = time.perf_counter()
    response = http.post(KINDS[kind], json=WeightsRequest(path=str(folder.resolve()), step=step).model_dump())
    round_trip = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{KINDS[kind]} {folder}: {response.status_code} {response.text}")
    return WeightsChange.model_validate(response.json()).seconds, round_trip


def interleaved(reloads: int) -> list[str]:
    """The kinds of the timed reloads: full, lora, lora, full, ... so that drift in the machine's load hits both."""
    order = []
    for repetition in range(reloads):
        order += list(KINDS) if repetition % 2 == 0 else list(reversed(KINDS))
    return order


def stats(export_s: list[float], server_s: list[float], round_trip_s: list[float]) -> dict:
    """Median and maximum of one kind's timings."""
    timings = {"export": export_s, "server": server_s, "round_trip": round_trip_s,
               "end_to_end": [e + r for e, r in zip(export_s, round_trip_s, strict=True)]}  # fmt: skip
    result = {}
    for name, seconds in timings.items():
        result |= {f"{name}_s": seconds, f"{name}_median_s": statistics.median(seconds), f"{name}_max_s": max(seconds)}
    return result


def measure(server_url: str, reloads: int, work_dir: Path, world: World, broadcast_port: int) -> dict:
    """Interleaved full, LoRA and shared-buffer reloads against the server; timings of each kind and their ratios."""
    model_folder = served_model(server_url)[1]
    serve_base_model(server_url)  # adapter names start again at step 1: none of an earlier user's may be served
    models = {kind: trainer_model(model_folder, kind, world) for kind in KINDS}
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    timings: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
    warm_ups = list(KINDS)
    sender = memory_sender("127.0.0.1", broadcast_port, REQUEST_TIMEOUT_S, "shared", torch.device("cpu"))
    with httpx.Client(base_url=server_url, timeout=REQUEST_TIMEOUT_S, headers=auth_headers()) as http:
        for step, kind in enumerate([*warm_ups, *interleaved(reloads)], start=1):  # a new adapter name per step
            folder = work_dir / f"step_{step}"
            export_s = export(models[kind], tokenizer, kind, folder, sender)
            seconds = (export_s, *reload(http, kind, folder, step))
            shutil.rmtree(work_dir / f"step_{step - 2}", ignore_errors=True)  # the server has moved past it
            if step > len(warm_ups):
                timings[kind].append(seconds)
    sender.wait()
    sender.close()
    serve_base_model(server_url)  # retire the last adapter
    kinds = {kind: stats(*zip(*timings[kind], strict=True)) for kind in KINDS}
    adapter = next(folder for folder in step_dirs(work_dir).values() if is_adapter(folder))
    return {
        "model": model_summary(model_folder) | {"adapter_bytes": adapter_bytes(adapter)},
        **kinds,
        **{f"{ratio}_{name}": kinds[top][f"{name}_median_s"] / kinds[bottom][f"{name}_median_s"]
           for ratio, (top, bottom) in COMPARED.items() for name in ("export", "server", "round_trip", "end_to_end")},
    }  # fmt: skip


def measure_model(
    shape: dict[str, int], server: str | None, reloads: int, work_dir: Path, world: World, broadcast_port: int
) -> dict:
    """Serve the tiny model reshaped by ``shape`` (or use ``server``) and measure its reloads, the shared buffer's
    through the trainer's store on ``broadcast_port``."""
    model = benchmark_model(shape, work_dir / "model")
    with server_for(server, model, LORA_RANK, work_dir, broadcast_port=broadcast_port) as server_url:
        return measure(server_url, reloads, work_dir, world, broadcast_port)


def run_benchmark(bench: BenchmarkConfig, server: str | None, work_dir: Path, broadcast_port: int) -> dict:
    """Each model of ``bench`` in turn (only the served one with ``server``); the results as a JSON-able dict."""
    models = {"served": {}} if server else bench.models
    results = {}
    world = init_world()  # one rank: the trainer's models are built as the trainer builds them
    try:
        for name, shape in models.items():
            (work_dir / name).mkdir()
            results[name] = measure_model(shape, server, bench.reloads, work_dir / name, world, broadcast_port)
    finally:
        close_world()
    return benchmark_result(
        "reload_latency",
        config=asdict(bench) | {"lora_rank": LORA_RANK, "lora_targets": LORA_TARGETS, "server": server},
        models=results,
    )


def summary_table(result: dict) -> str:
    """A few lines for the terminal: medians (and maxima) in seconds."""
    columns = ("export", "server", "round_trip", "end_to_end")
    rows = [f"{'model':8}{'kind':6}{'MB':>9}" + "".join(f"{name:>18}" for name in columns)]
    for name, model in result["models"].items():
        for kind in KINDS:
            size = model["model"]["adapter_bytes"] if kind == "lora" else model["model"]["weights_bytes"]
            s = model[kind]
            times = "".join(f"{s[f'{c}_median_s']:>10.4f} ({s[f'{c}_max_s']:.3f})" for c in columns)
            rows.append(f"{name:8}{kind:6}{size / 1e6:>9.3f}{times}")
        for ratio, (top, bottom) in COMPARED.items():
            ratios = ", ".join(f"{c} {model[f'{ratio}_{c}']:.2f}" for c in columns)
            rows.append(f"{name:8}{top} / {bottom}: {ratios}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = benchmark_parser(__doc__, "reload_latency", "a short run: 2 reloads of each kind, tiny model", server=True)
    parser.add_argument("--broadcast-port", type=int, help="with --server: its [weight_broadcast] port")
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    transformers.utils.logging.disable_progress_bar()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's side, as rl runs it on CPU beside the server (OMP_NUM_THREADS=1)
    try:
        with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="trident-bench-reload-", dir=args.work_dir) as tmp:
            result = run_benchmark(bench, args.server, Path(tmp), args.broadcast_port or free_port())
    finally:
        torch.set_num_threads(threads)
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
