"""Benchmark: the memory plan's trainer figures against the peak memory a training step really takes, on CPU.

``uv run python benchmarks/memory_plan.py`` (``--smoke``: the tiny model only).

For each case (a model shape and a trainer config: full training, LoRA or QLoRA, with or without activation
checkpointing) a fresh child process builds the trainer's model as ``rl`` does (a one-rank FSDP2 group,
``build_model``, AdamW) and runs two training steps on one packed micro-batch of ``seq_len`` tokens, all but the
first 16 under the loss mask. Its resident memory is read from ``/proc/self/status``: before the model is built
(the baseline: Python, torch and the imports), and the peak during the two steps (the high-water mark is reset
once the model is built, so loading it does not count). glibc is told to give freed blocks of 64 KiB or more
back at once (``MALLOC_MMAP_THRESHOLD_``), so that resident memory follows the live tensors, as a GPU's
allocated-memory counter does, instead of the allocator's cache. The measured figure is that peak above the baseline;
the plan's is ``trainer.plan.trainer_plan`` for the same config on CPU. Their ratio says how far the plan is
from the truth; on GPU the plan adds the CUDA context.
"""

import multiprocessing
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import benchmark_model, benchmark_parser, machine_info, report, reset_peak_rss, rss_mib, utc_now

TOKENS_UNTRAINED = 16  # the packed sample's prompt


@dataclass(frozen=True)
class Case:
    name: str
    shape: dict[str, int]  # overrides of the tiny model's config (empty: the tiny model)
    model: dict = field(default_factory=dict)  # the trainer's [model] section, beyond its name
    seq_len: int = 2048


MID = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
       "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32_768}  # fmt: skip
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]}  # fmt: skip
FULL = [
    Case("tiny, full", {}, seq_len=1024),
    Case("mid, full", MID),
    Case("mid, full, checkpointing", MID, {"ac": {"freq": 1}}),
    Case("mid, LoRA, checkpointing", MID, {"ac": {"freq": 1}, "experimental": {"lora": LORA}}),
    Case("mid, QLoRA, checkpointing", MID, {"ac": {"freq": 1}, "experimental": {"lora": LORA, "load_in_4bit": True}}),
]
SMOKE = [Case("tiny, full", {}, seq_len=256)]


def measure(case: Case, model_dir: str, queue) -> None:
    """In a child process: build the trainer's model, run two steps; put the peak above the baseline on ``queue``."""
    torch.set_num_threads(1)
    from contracts.protocol import BatchInfo, MicroBatch, Sample
    from trainer.config import TrainerConfig
    from trainer.optim import build_optimizer
    from trainer.parallel import close_world, init_world, rank_share
    from trainer.train import build_model, train_step

    config = TrainerConfig(model={"name": model_dir, **case.model}, seq_len=case.seq_len)
    world = init_world()
    baseline = rss_mib("VmRSS")
    model = build_model(config.model, world, offload=False)
    optimizer, _ = build_optimizer(model, config.optim, 2)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (case.seq_len,), generator=torch.Generator().manual_seed(0)).tolist()
    mask = [i >= TOKENS_UNTRAINED for i in range(case.seq_len)]
    logprobs = [-10.0 if m else 0.0 for m in mask]
    micro_batch = MicroBatch.pack([Sample(ids, mask, logprobs, 1.0, 0.0, 0)])
    info = BatchInfo(0, 1, case.seq_len, sum(mask), 0.0, 1.0)
    reset_peak_rss()  # the peak so far (loading the model) does not count
    for _ in range(2):  # the first step creates AdamW's moments
        train_step(model, optimizer, rank_share([micro_batch], world), info, config, world)
    queue.put({"measured_mib": rss_mib("VmHWM") - baseline, "baseline_mib": baseline})
    close_world()


def run_case(case: Case, tmp: Path) -> dict:
    from contracts.model_card import ModelCard
    from trainer.config import TrainerConfig
    from trainer.plan import trainer_plan

    model_dir = benchmark_model(case.shape, tmp / case.name)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=measure, args=(case, model_dir, queue))
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by the child's glibc when it starts
    try:
        process.start()
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    measured = queue.get()
    process.join()
    config = TrainerConfig(model={"name": model_dir, **case.model}, seq_len=case.seq_len)
    plan = trainer_plan(ModelCard.of(model_dir).hub_shape(), config, ranks=1, gpu=False)
    ratio = plan["total"] * 1024 / measured["measured_mib"]
    return asdict(case) | measured | {"plan_gib": plan, "planned_over_measured": ratio}


def summary_table(result: dict) -> str:
    rows = [f"{'case':28}{'measured MiB':>14}{'planned MiB':>13}{'plan/measured':>15}"]
    for case in result["cases"]:
        rows.append(f"{case['name']:28}{case['measured_mib']:>14.0f}{case['plan_gib']['total'] * 1024:>13.0f}"
                    f"{case['planned_over_measured']:>15.2f}")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "memory_plan", "the tiny model at 256 tokens")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        cases = [run_case(case, Path(tmp)) for case in (SMOKE if args.smoke else FULL)]
    result = {"benchmark": "memory_plan", "date": utc_now(), "machine": machine_info(), "cases": cases}
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
