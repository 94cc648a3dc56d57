"""Profile: the trainer's step on a batch shaped like ``trl_grpo.py --larger``'s, no server, CPU-independent counts.

``uv run --no-sync python benchmarks/trainer_step_profile.py OUT_DIR`` (``--smoke``: the tiny model's shape, few
samples). To compare with an older commit, run the same file with that commit's ``src`` first on ``PYTHONPATH``
(its modules under ``rl`` instead of ``contracts`` are found too).

The step is the trainer's own (``build_model``, ``build_optimizer``, ``train_step`` over ``rank_share``) on a
one-rank group, the trainer config being the CPU debug run's as ``trl_grpo.py`` starts it (defaults, its learning
rate). The batch: ``batch_size × group_size`` samples of a char-target prompt (49 tokens, what the tiny model's chat
template makes of one) and ``max_tokens`` sampled tokens, packed into ``seq_len`` micro-batches as the orchestrator
packs them, sampled by the weights one step older than the step.

After one warm-up step, one step runs under ``torch.profiler`` (CPU, shapes and FLOPs recorded), then ``--timed``
steps on the process's CPU clock (a hint only: on a shared machine even CPU time moves with the load). Written to
``OUT_DIR``: ``ops.json`` (per op: calls, self CPU µs, FLOPs; per module class: forward calls, backward
recomputations included), ``ops.txt`` (the op table by self CPU time, and by input shape). Wall times mean little on
a loaded machine: compare the calls, shapes and FLOPs, and the self CPU shares.
"""

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import build_random_model  # noqa: E402
from trl_grpo import LARGER  # noqa: E402

try:
    from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_samples
except ImportError:  # a commit from before src/rl became src/contracts
    from rl.protocol import BatchInfo, MicroBatch, Sample, pack_samples
from trainer.config import TrainerConfig  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.parallel import close_world, init_world, rank_share  # noqa: E402
from trainer.train import build_model, train_step  # noqa: E402

PROMPT_TOKENS = 49  # a char-target prompt under the tiny model's chat template (45-51 over the first 80 tasks)
STEP = 3  # the profiled batch's step: its samples come from weights STEP - 1


def larger_samples(num_samples: int, prompt: int, completion: int, vocab_size: int) -> list[Sample]:
    """Random samples of ``prompt`` prompt tokens and ``completion`` sampled ones (logprobs near a random model's)."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(num_samples):
        token_ids = torch.randint(0, vocab_size, (prompt + completion,), generator=generator).tolist()
        logprobs = -math.log(vocab_size) + 0.05 * torch.randn(completion, generator=generator)
        advantage = float(torch.randn(1, generator=generator))
        loss_mask = [False] * prompt + [True] * completion
        samples.append(Sample(token_ids, loss_mask, [0.0] * prompt + logprobs.tolist(), advantage, 0.0, STEP - 1))
    return samples


def module_calls(model: torch.nn.Module) -> Counter:
    """Forward calls per module class from now on (a checkpointed module's recomputation counts again)."""
    calls = Counter()
    for module in model.modules():
        module.register_forward_hook(lambda m, *_: calls.update([type(m).__name__]))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="the tiny model's shape, 4 samples of 8 + 8 tokens")
    parser.add_argument("--samples", type=int, help="samples in the batch (default: the workload's 64)")
    parser.add_argument("--timed", type=int, default=2, help="steps timed after the profiled one (process CPU s)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # as rl runs the trainer on CPU
    shape = {} if args.smoke else LARGER.shape
    num_samples, completion = (4, 8) if args.smoke else (LARGER.batch_size * LARGER.group_size, LARGER.max_tokens)
    num_samples = args.samples or num_samples
    prompt = 8 if args.smoke else PROMPT_TOKENS
    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_random_model(Path(folder) / "model", shape)
        config = TrainerConfig(model={"name": str(model_dir)}, optim={"lr": LARGER.lr}, output_dir=Path(folder))
        world = init_world()
        try:
            torch.manual_seed(config.seed)
            model = build_model(config.model, world, config.optim.offload)
            optimizer, _ = build_optimizer(model, config.optim, config.max_steps)
            samples = larger_samples(num_samples, prompt, completion, model.config.vocab_size)
            micro_batches = [MicroBatch.pack(b) for b in pack_samples(samples, config.seq_len)]
            tokens = sum(len(s.token_ids) for s in samples)
            loss_tokens = sum(sum(s.loss_mask) for s in samples)
            info = BatchInfo(step=STEP, num_samples=len(samples), num_tokens=tokens, num_loss_tokens=loss_tokens,
                             reward_mean=0.0, temperature=LARGER.temperature, weight_steps=[STEP - 1])  # fmt: skip
            share = rank_share(micro_batches, world)
            train_step(model, optimizer, share, info, config, world)  # warm-up
            calls = module_calls(model)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
                metrics = train_step(model, optimizer, share, info, config, world)
            step_cpu_s = []
            for _ in range(args.timed):
                start = time.process_time()
                train_step(model, optimizer, share, info, config, world)
                step_cpu_s.append(time.process_time() - start)
        finally:
            close_world()
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    result = {
        "micro_batches": [len(m.input_ids) for m in micro_batches],
        "tokens": tokens,
        "metrics": metrics,
        "step_cpu_s": step_cpu_s,
        "module_calls": dict(calls.most_common()),
        "flops": sum(e.flops for e in events),
        "self_cpu_us": total_us,
        "ops": {
            e.key: {"calls": e.count, "self_cpu_us": e.self_cpu_time_total, "flops": e.flops}
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)
        },
    }
    (args.out_dir / "ops.json").write_text(json.dumps(result, indent=1) + "\n")
    by_shape = prof.key_averages(group_by_input_shape=True)
    (args.out_dir / "ops.txt").write_text(
        events.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=60)
        + "\n\n"
        + by_shape.table(
            sort_by="self_cpu_time_total", row_limit=80, max_name_column_width=50, max_shapes_column_width=90
        )
    )
    print(json.dumps({k: result[k] for k in ("micro_batches", "tokens", "flops", "self_cpu_us", "step_cpu_s")}))


if __name__ == "__main__":
    main()
