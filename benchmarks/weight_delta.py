"""Benchmark: weight deltas (``[weights] delta``) against full weights, per step: the bytes a step's weights take,
the share of elements unchanged in the served dtype, and the time to make and to load each.

``uv run --no-sync python benchmarks/weight_delta.py`` (``--smoke``: the tiny model, one learning rate, 2 steps).

For each model (the tiny model, and a random Qwen3 of a few hundred million parameters with the tiny model's config
and vocabulary, built as ``common.build_random_model`` builds one, in memory), each served dtype and each learning
rate (1e-6 and 1e-5, of full fine-tuning, and the debug run's 3e-3), float32 master weights, loaded from a
checkpoint in the served dtype (each starts as a value of that dtype, as a bf16 model's do), take ``STEPS`` AdamW
steps (weight decay 0.01, as torch's default) on random gradients; after each, the trainer's weights cast to the
served dtype are encoded against the copy served before (``contracts.weight_delta.encode``), serialized as a delta
file (``safetensors``, in memory), read back and applied to the server's copy, which must then equal the trainer's
bit for bit (checked), and both sides checksum their copy. The full counterpart serializes the whole cast weights
and reads them back. Times are one thread's (``torch.set_num_threads(1)``, as ``rl`` runs a process on CPU);
bytes and shares do not depend on the machine, times do.
"""

import time

import common
import torch
from safetensors.torch import load, save

from contracts.model_path import TINY_MODEL_ID
from contracts.weight_delta import apply, checksum, encode, from_tensors, raw_bits, to_tensors
from tools.tiny_model import built_model_path

LARGE = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
LRS = {"1e-6": 1e-6, "1e-5": 1e-5, "debug 3e-3": 3e-3}
STEPS, SMOKE_STEPS = 3, 2
CASES = [("tiny", "bfloat16"), ("tiny", "float32"), ("large", "bfloat16")]  # float32: what the CPU serves


def random_model(shape: dict[str, int], seed: int = 0) -> torch.nn.Module:
    """The tiny model's architecture reshaped by ``shape``, randomly initialized (``build_random_model``'s model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(built_model_path(TINY_MODEL_ID))
    for name, value in shape.items():
        setattr(config, name, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def run_steps(weights: dict[str, torch.Tensor], dtype: torch.dtype, lr: float, steps: int) -> list[dict]:
    """``steps`` AdamW steps from ``weights`` (float32) on random gradients; per step, delta against full."""
    torch.manual_seed(1)
    # the master weights as loaded from a checkpoint in the served dtype: each a value of that dtype
    master = [torch.nn.Parameter(tensor.to(dtype).to(torch.float32, copy=True)) for tensor in weights.values()]
    names = list(weights)
    optimizer = torch.optim.AdamW(master, lr=lr)
    trainer_copy = {name: p.detach().to(dtype, copy=True) for name, p in zip(names, master, strict=True)}
    server_copy = {name: tensor.clone() for name, tensor in trainer_copy.items()}
    elements = sum(tensor.numel() for tensor in trainer_copy.values())
    clock = time.perf_counter
    records = []
    for step in range(1, steps + 1):
        for parameter in master:
            parameter.grad = torch.randn_like(parameter)
        optimizer.step()
        trained = dict(zip(names, (p.detach() for p in master), strict=True))
        start = clock()  # the trainer: diff against its copy, serialize
        deltas = {name: encode(trainer_copy[name], tensor) for name, tensor in trained.items()}
        payload = save(to_tensors(deltas))
        make_s = clock() - start
        changed = 0
        for name, delta in deltas.items():
            if delta.encoding == "sparse":
                changed += delta.indices.numel()
            elif delta.encoding == "dense":
                changed += int((raw_bits(delta.values) != raw_bits(trainer_copy[name])).sum())
            apply(delta, trainer_copy[name])
        start = clock()  # the server: read, apply to its copy
        for name, delta in from_tensors(load(payload)).items():
            apply(delta, server_copy[name])
        load_s = clock() - start
        start = clock()
        for tensor in server_copy.values():
            checksum(tensor)
        checksum_s = clock() - start
        start = clock()  # full weights: cast and serialize, then read
        cast = {name: tensor.to(dtype) for name, tensor in trained.items()}
        full = save(cast)
        full_make_s = clock() - start
        start = clock()
        load(full)
        full_load_s = clock() - start
        for name, tensor in cast.items():
            assert torch.equal(raw_bits(server_copy[name]), raw_bits(tensor)), f"step {step}: {name} differs"
        encodings = [delta.encoding for delta in deltas.values()]
        records.append({
            "step": step,
            "unchanged_share": round(1 - changed / elements, 6),
            "tensors": {kind: encodings.count(kind) for kind in ("none", "sparse", "dense")},
            "delta_bytes": len(payload),
            "full_bytes": len(full),
            "bytes_ratio": round(len(full) / max(len(payload), 1), 2),
            "delta_make_s": round(make_s, 4),
            "delta_load_s": round(load_s, 4),
            "full_make_s": round(full_make_s, 4),
            "full_load_s": round(full_load_s, 4),
            "checksum_s": round(checksum_s, 4),  # either side, the whole copy
        })  # fmt: skip
        print(f"  step {step}: unchanged {records[-1]['unchanged_share']:.4f}, {len(payload):,} bytes against "
              f"{len(full):,}, make {make_s:.3f}s, load {load_s:.3f}s", flush=True)  # fmt: skip
    return records


def run(smoke: bool) -> dict:
    torch.set_num_threads(1)
    steps = SMOKE_STEPS if smoke else STEPS
    lrs = {"1e-5": LRS["1e-5"]} if smoke else LRS
    cases = CASES[:1] if smoke else CASES
    results, models = [], {}
    for model_name, dtype_name in cases:
        if model_name not in models:
            model = random_model({} if model_name == "tiny" else LARGE)
            models = {model_name: {name: p.detach() for name, p in model.named_parameters()}}
        weights = models[model_name]
        parameters = sum(tensor.numel() for tensor in weights.values())
        for lr_name, lr in lrs.items():
            print(f"{model_name} ({parameters:,} parameters) in {dtype_name} at lr {lr_name}", flush=True)
            steps_run = run_steps(weights, getattr(torch, dtype_name), lr, steps)
            results.append({"model": model_name, "parameters": parameters, "dtype": dtype_name, "lr": lr,
                            "steps": steps_run})  # fmt: skip
    return common.benchmark_result("weight_delta", threads=1, steps=steps, large_shape=LARGE, results=results)


def table(result: dict) -> str:
    lines = [
        "| model | dtype | lr | step | unchanged | tensors none/sparse/dense | delta bytes | full bytes | full / delta "
        "| delta make / load s | full make / load s | checksum s |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for entry in result["results"]:
        for r in entry["steps"]:
            kinds = "/".join(str(r["tensors"][kind]) for kind in ("none", "sparse", "dense"))
            lines.append(
                f"| {entry['model']} | {entry['dtype']} | {entry['lr']:g} | {r['step']} | {r['unchanged_share']:.4f} "
                f"| {kinds} | {r['delta_bytes']:,} | {r['full_bytes']:,} | {r['bytes_ratio']} "
                f"| {r['delta_make_s']:.3f} / {r['delta_load_s']:.3f} "
                f"| {r['full_make_s']:.3f} / {r['full_load_s']:.3f} | {r['checksum_s']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return common.run_and_report(argv, __doc__, "weight_delta", "the tiny model, lr 1e-5, 2 steps", run, table)


if __name__ == "__main__":
    main()
