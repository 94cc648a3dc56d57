"""Benchmark: the trainer's step on GRPO groups, each group's prompt computed once (share_prefixes) against whole.

``uv run --no-sync python benchmarks/shared_prefix.py`` (``--smoke``: the tiny model, 2 groups of 2, one pair).

The step is the trainer's own (``build_model``, ``micro_batches_to_train``, ``train_step``) on one rank and one
thread, as ``rl`` runs it on the CPU, with ``trl_grpo.py --larger``'s model shape (a random model) and batch:
``batch_size`` groups of ``group_size`` samples, each group one prompt of 49 random tokens (what the tiny model's
chat template makes of a char-target task) and each sample 90 to ``max_tokens`` sampled tokens, packed into
``seq_len`` micro-batches as the orchestrator packs them. Settings alternate (off, on, off, on, ...), each a fresh
model and optimizer, one warm-up step then ``TIMED`` steps on the process's CPU clock (CPU seconds move less than
wall seconds with the machine's load). Also recorded: the tokens each setting computes, and the first step's loss
and gradient norm under both (they must agree: the same step, computed differently).
"""

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_parser, benchmark_result, build_random_model, report  # noqa: E402
from trl_grpo import LARGER  # noqa: E402

from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_samples  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.parallel import close_world, init_world, rank_share  # noqa: E402
from trainer.shared_prefix import computed_tokens  # noqa: E402
from trainer.train import build_model, micro_batches_to_train, train_step  # noqa: E402

PROMPT_TOKENS = 49
SHORTEST = 90  # sampled tokens: uniform from here to max_tokens
TIMED = 2
PAIRS = 3
STEP = 3


def grouped_samples(groups: int, group_size: int, longest: int, vocab_size: int) -> list[Sample]:
    """``groups`` × ``group_size`` random samples, a group's sharing its prompt."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(groups):
        prompt = torch.randint(0, vocab_size, (PROMPT_TOKENS,), generator=generator).tolist()
        for _ in range(group_size):
            n = int(torch.randint(min(SHORTEST, longest), longest + 1, (1,), generator=generator))
            logprobs = (-math.log(vocab_size) + 0.05 * torch.randn(n, generator=generator)).tolist()
            advantage = float(torch.randn(1, generator=generator))
            ids = prompt + torch.randint(0, vocab_size, (n,), generator=generator).tolist()
            mask = [False] * PROMPT_TOKENS + [True] * n
            samples.append(Sample(ids, mask, [0.0] * PROMPT_TOKENS + logprobs, advantage, 0.0, STEP - 1))
    return samples


def measure(model_dir: Path, samples: list[Sample], share: bool, timed: int) -> dict:
    """One setting: a fresh model and optimizer, a warm-up step, then ``timed`` steps on the process's CPU clock."""
    config = TrainerConfig(model={"name": str(model_dir)}, optim={"lr": LARGER.lr}, share_prefixes=share)
    world = init_world()
    try:
        torch.manual_seed(config.seed)
        model = build_model(config.model, world, config.optim.offload)
        optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
        packed = [MicroBatch.pack(b) for b in pack_samples(samples, config.seq_len)]
        micro_batches = micro_batches_to_train(packed, config, STEP, share)
        computed = sum(computed_tokens(micro_batch, share) for micro_batch in micro_batches)
        info = BatchInfo(step=STEP, num_samples=len(samples), num_tokens=sum(len(s.token_ids) for s in samples),
                         num_loss_tokens=sum(sum(s.loss_mask) for s in samples), reward_mean=0.0,
                         temperature=LARGER.temperature, weight_steps=[STEP - 1])  # fmt: skip
        first = train_step(model, optimizer, rank_share(micro_batches, world), info, config, world)
        cpu_s, wall_s = [], []
        for _ in range(timed):
            start, began = time.process_time(), time.perf_counter()
            train_step(model, optimizer, rank_share(micro_batches, world), info, config, world)
            cpu_s.append(time.process_time() - start)
            wall_s.append(time.perf_counter() - began)
    finally:
        close_world()
    return {"share_prefixes": share, "micro_batches": len(micro_batches), "computed_tokens": computed,
            "cpu_s_per_step": statistics.mean(cpu_s), "wall_s_per_step": statistics.mean(wall_s),
            "first_loss": first["loss"], "first_grad_norm": first["grad_norm"]}  # fmt: skip


def run(smoke: bool) -> dict:
    torch.set_num_threads(1)  # as rl runs the trainer on the CPU
    shape = {} if smoke else LARGER.shape
    groups, group_size, longest = (2, 2, 8) if smoke else (LARGER.batch_size, LARGER.group_size, LARGER.max_tokens)
    pairs, timed = (1, 1) if smoke else (PAIRS, TIMED)
    with tempfile.TemporaryDirectory(prefix="trident-shared-prefix-") as folder:
        model_dir = build_random_model(Path(folder) / "model", shape)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        samples = grouped_samples(groups, group_size, longest, vocab_size)
        runs = [measure(model_dir, samples, share, timed) for _ in range(pairs) for share in (False, True)]
    ratios = [off["cpu_s_per_step"] / on["cpu_s_per_step"] for off, on in zip(runs[::2], runs[1::2], strict=True)]
    return benchmark_result(
        "shared_prefix",
        config={
            "shape": shape,
            "groups": groups,
            "group_size": group_size,
            "prompt_tokens": PROMPT_TOKENS,
            "sampled_tokens": [min(SHORTEST, longest), longest],
            "pairs": pairs,
            "timed_steps": timed,
        },  # fmt: skip
        runs=runs,
        tokens=sum(len(s.token_ids) for s in samples),
        cpu_ratio_off_over_on={"median": statistics.median(ratios), "each": ratios},
    )


def table(result: dict) -> str:
    lines = ["share_prefixes  micro-batches  computed tokens  CPU s/step  wall s/step  first loss"]
    for r in result["runs"]:
        lines.append(f"{r['share_prefixes']!s:>14}  {r['micro_batches']:>13}  {r['computed_tokens']:>15}  "
                     f"{r['cpu_s_per_step']:>10.2f}  {r['wall_s_per_step']:>11.2f}  {r['first_loss']:.8f}")  # fmt: skip
    ratio = result["cpu_ratio_off_over_on"]
    each = ", ".join(f"{x:.2f}" for x in ratio["each"])
    lines.append(f"CPU per step, whole over shared: {ratio['median']:.2f}x (pairs: {each})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = benchmark_parser(__doc__, "shared_prefix", "the tiny model, 2 groups of 2, one pair").parse_args(argv)
    result = run(args.smoke)
    return report(args.output, result, table(result))


if __name__ == "__main__":
    main()
