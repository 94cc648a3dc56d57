"""Benchmark: context parallelism on two CPU ranks. A trainer step of tiny-qwen3 (LoRA, every layer checkpointed)
on long packed samples with cp = 1 (each rank its own micro-batch) beside cp = 2 (both ranks split each micro-batch),
and with ``[model.ac] offload`` at cp = 1: step time and peak resident memory per rank.

``uv run --no-sync python benchmarks/context_parallel.py`` (``--smoke``: 1,024-token samples, one timed step). It runs
itself under ``torchrun --nproc-per-node 2`` (gloo), once per setting (each its own processes' peak memory).

The batch: two micro-batches, each one sample of ``TOKENS`` tokens (the last half sampled). At cp = 1 each rank runs
one whole micro-batch; at cp = 2 each rank runs both, half of each one's tokens (Ulysses: attention over the whole
row with half the heads), so both settings do the same work in all. The model: trident/tiny-qwen3's shape with room
for the samples' positions. Offload is a no-op on the CPU (the trainer keeps it for CUDA, where a host copy is a
move): its row measures that it costs nothing here, not what it saves on a GPU (benchmarks/gpu_check.py does).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import torch
import torch.distributed as dist

from contracts.protocol import BatchInfo, MicroBatch, Sample
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer, clip_gradients
from trainer.parallel import World, close_world, init_world, rank_share
from trainer.train import build_model, forward_backward, frozen_reference

TOKENS = 8192
SMOKE_TOKENS = 1024
STEPS = 3  # timed steps per setting, after one untimed
LORA = {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
SETTINGS = {"cp 1": (1, False), "cp 2": (2, False), "cp 1 + offload": (1, True)}


def long_samples(tokens: int) -> list:
    """The batch's two samples of ``tokens`` random tokens, the last half sampled."""
    generator = torch.Generator().manual_seed(0)
    prompt = tokens // 2
    return [
        Sample(torch.randint(0, 2000, (tokens,), generator=generator).tolist(), [False] * prompt + [True] * prompt,
               [0.0] * prompt + (-7.6 + 0.05 * torch.randn(prompt, generator=generator)).tolist(), 0.7, 0.0, 0)
        for _ in range(2)
    ]  # fmt: skip


def time_setting(model_dir: Path, output_dir: Path, tokens: int, steps: int, world: World, offload: bool) -> dict:
    """Steps of one setting on this rank: the median step's seconds and this rank's peak resident memory."""
    config = TrainerConfig(
        model={"name": str(model_dir), "experimental": {"lora": LORA}, "ac": {"offload": offload},
               "parallel": {"cp": world.cp}},
        output_dir=output_dir, seq_len=tokens, optim={"lr": 1e-4}, max_steps=steps + 1,
    )  # fmt: skip
    samples = long_samples(tokens)
    micro_batches = [MicroBatch.pack([sample]) for sample in samples]
    num_loss = sum(sum(s.loss_mask) for s in samples)
    dist.barrier()
    start_rss = common.rss_mib("VmRSS")
    model = build_model(config.model, world, offload=False)
    optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
    reference = frozen_reference(model, config, world)
    seconds = []
    for step in range(1, steps + 2):
        info = BatchInfo(step, len(samples), 2 * tokens, num_loss, 0.0, 0.7)
        dist.barrier()
        start = time.perf_counter()
        forward_backward(model, rank_share(micro_batches, world), info, config, world, reference)
        clip_gradients(model, config.optim.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return {"step_s": statistics.median(seconds[1:]), "peak_rss_mib": common.rss_mib("VmHWM"),
            "rss_at_start_mib": start_rss}  # fmt: skip


def ranks(folder: Path, setting: str, smoke: bool) -> None:
    """What each of the two ranks runs: one setting; rank 0 writes ``folder/<setting>.json``."""
    tokens, steps = (SMOKE_TOKENS, 1) if smoke else (TOKENS, STEPS)
    cp, offload = SETTINGS[setting]
    world = init_world(cp)
    if cp == 1:
        world = World(world.rank, world.size, world.device)
    try:
        mine = time_setting(folder / "model", folder / setting.replace(" ", "_"), tokens, steps, world, offload)
        every = [None] * world.size
        dist.all_gather_object(every, mine)
        if world.is_main:
            result = {"cp": cp, "offload": offload, "step_s": max(r["step_s"] for r in every),
                      "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in every],
                      "rss_at_start_mib_per_rank": [r["rss_at_start_mib"] for r in every]}  # fmt: skip
            (folder / f"{setting}.json").write_text(json.dumps(result))
    finally:
        close_world()


def run(smoke: bool) -> dict:
    """Each setting in its own torchrun launch (a fresh process's peak memory), in turn."""
    tokens = SMOKE_TOKENS if smoke else TOKENS
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        common.build_random_model(Path(tmp) / "model", {"max_position_embeddings": 2 * tokens})
        settings = {}
        for setting in SETTINGS:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__]
            subprocess.run([*command, "--ranks", tmp, "--setting", setting, *(["--smoke"] if smoke else [])],
                           check=True)  # fmt: skip
            settings[setting] = json.loads((Path(tmp) / f"{setting}.json").read_text())
    cp_1, cp_2 = settings["cp 1"], settings["cp 2"]
    ratios = {"cp_2_over_cp_1_step_s": cp_2["step_s"] / cp_1["step_s"],
              "offload_over_cp_1_step_s": settings["cp 1 + offload"]["step_s"] / cp_1["step_s"]}  # fmt: skip
    return common.benchmark_result("context_parallel", lora=LORA, steps=1 if smoke else STEPS,
                                   tokens_per_sample=tokens, settings=settings, ratios=ratios)  # fmt: skip


def table(result: dict) -> str:
    rows = [f"{'setting':<16} {'step s':>8} {'peak RSS MiB per rank (at start)':>34}"]
    for name, setting in result["settings"].items():
        pairs = zip(setting["peak_rss_mib_per_rank"], setting["rss_at_start_mib_per_rank"], strict=True)
        rss = ", ".join(f"{peak:.0f} ({start:.0f})" for peak, start in pairs)
        rows.append(f"{name:<16} {setting['step_s']:>8.2f} {rss:>34}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ranks", type=Path)
    parser.add_argument("--setting", choices=SETTINGS)
    known, rest = parser.parse_known_args(argv)
    if known.ranks is not None:  # one of torchrun's two ranks
        return ranks(known.ranks, known.setting, "--smoke" in rest)
    return common.run_and_report(rest, __doc__, "context_parallel", "1,024-token samples, one timed step", run, table)


if __name__ == "__main__":
    main()
