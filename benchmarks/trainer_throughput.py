"""Benchmark: the trainer's tokens/s against a plain PyTorch loop, on the same model and data, in one run.

``uv run python benchmarks/trainer_throughput.py`` (``--smoke``: a seconds-long run at the tiny model's size).

Both sides start from the same random Qwen3 (the tiny model's config and vocabulary, made larger; the tiny
model's own shape under ``--smoke``), use the same number of torch threads (``--threads``; 1 by default, as
``rl`` runs each process on CPU) and train on the same RL-like samples: a prompt, a sampled completion under
the loss mask, the server's logprobs and one advantage per sample.

- **Trident** runs what the trainer runs per step: a one-rank FSDP2 group (``init_world``), ``build_model``,
  AdamW as ``train.py`` makes it, the samples packed into ``seq_len``-token micro-batches (``pack_samples``),
  and ``train_step`` over ``rank_share``. Left out: reading the batch from disk, the learning-rate scheduler
  (constant here) and writing weights for inference.
- **Plain** is a straightforward loop on an unsharded copy of the model: micro-batches of a fixed number of
  samples, right-padded to the longest one with an attention mask, logprobs by ``log_softmax``/``gather``, the
  same token-level policy-gradient loss (``-ratio · advantage`` summed over loss tokens / the step's loss
  tokens), backward, ``clip_grad_norm_``, AdamW step. Its micro-batch holds ``round(seq_len / mean sample
  length)`` samples: about as many real tokens as one packed micro-batch.

Both sides' batches are built once, outside the timing. Steps alternate between the sides (one warm-up step
each first, the order swapped every repetition), timed on the wall clock and in process CPU time, and the
medians are compared: the machine is shared and noisy, so only ratios measured side by side mean something.
The warm-up step is also the check that both sides do the same work: from the same weights, on the same data,
they must agree on the loss and the gradient norm.
"""

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from common import benchmark_parser, benchmark_result, build_random_model, report
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_samples
from trainer.config import TrainerConfig
from trainer.parallel import World, close_world, init_world, rank_share
from trainer.train import build_model, train_step

TEMPERATURE = 1.0
SIDES = ("trident", "plain")
# Wall-clock time, and this process's CPU time: on a shared machine the second barely counts the time the
# process waited for a core, so its ratio is the steadier one (both are the same on an idle machine).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class BenchmarkConfig:
    """The model, the data and the number of timed steps of one benchmark run."""

    model_shape: dict[str, int]  # overrides of the tiny model's config; empty: the tiny model's own shape
    num_samples: int
    prompt_tokens: tuple[int, int]  # inclusive range of a sample's prompt length
    completion_tokens: tuple[int, int]  # inclusive range of a sample's completion length
    seq_len: int  # tokens per packed micro-batch (Trident)
    repetitions: int  # timed steps per side, after one warm-up step each
    seed: int = 0


FULL = BenchmarkConfig(
    model_shape={
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    num_samples=24,
    prompt_tokens=(16, 128),
    completion_tokens=(16, 256),
    seq_len=1024,
    repetitions=5,
)
SMOKE = BenchmarkConfig(
    model_shape={}, num_samples=8, prompt_tokens=(4, 16), completion_tokens=(4, 32), seq_len=128, repetitions=1
)


@dataclass
class PaddedBatch:
    """Samples right-padded to the longest one: the plain loop's micro-batch."""

    input_ids: Int[Tensor, "batch seq"]
    attention_mask: Int[Tensor, "batch seq"]
    loss_mask: Bool[Tensor, "batch seq"]
    inference_logprobs: Float[Tensor, "batch seq"]
    advantages: Float[Tensor, " batch"]


def rl_samples(config: BenchmarkConfig, vocab_size: int) -> list[Sample]:
    """Random prompts and completions of varied lengths; the completion is under the loss mask, with logprobs
    near a random model's (about ``-log(vocab_size)``, so no importance ratio is out of bounds)."""
    generator = torch.Generator().manual_seed(config.seed)

    def randint(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=generator))

    samples = []
    for _ in range(config.num_samples):
        prompt, completion = randint(config.prompt_tokens), randint(config.completion_tokens)
        token_ids = torch.randint(0, vocab_size, (prompt + completion,), generator=generator).tolist()
        logprobs = -math.log(vocab_size) + 0.05 * torch.randn(completion, generator=generator)
        advantage = float(torch.randn(1, generator=generator))
        loss_mask = [False] * prompt + [True] * completion
        samples.append(Sample(token_ids, loss_mask, [0.0] * prompt + logprobs.tolist(), advantage, 0.0, 0))
    return samples


def batch_info(samples: list[Sample]) -> BatchInfo:
    """The step metadata the orchestrator would write next to these samples."""
    num_tokens = sum(len(s.token_ids) for s in samples)
    num_loss_tokens = sum(sum(s.loss_mask) for s in samples)
    return BatchInfo(0, len(samples), num_tokens, num_loss_tokens, reward_mean=0.0, temperature=TEMPERATURE)


def pad_samples(samples: list[Sample], pad_id: int) -> PaddedBatch:
    """Right-pad ``samples`` to the longest one."""
    length = max(len(s.token_ids) for s in samples)

    def padded(values: Callable[[Sample], list], fill, dtype: torch.dtype) -> Tensor:
        return torch.tensor([values(s) + [fill] * (length - len(s.token_ids)) for s in samples], dtype=dtype)

    return PaddedBatch(
        input_ids=padded(lambda s: s.token_ids, pad_id, torch.long),
        attention_mask=padded(lambda s: [1] * len(s.token_ids), 0, torch.long),
        loss_mask=padded(lambda s: s.loss_mask, False, torch.bool),
        inference_logprobs=padded(lambda s: s.inference_logprobs, 0.0, torch.float32),
        advantages=torch.tensor([s.advantage for s in samples]),
    )


def plain_batch_size(samples: list[Sample], seq_len: int) -> int:
    """Samples per padded micro-batch holding about as many real tokens as one ``seq_len`` packed micro-batch."""
    mean_length = sum(len(s.token_ids) for s in samples) / len(samples)
    return max(1, round(seq_len / mean_length))


def plain_loss(model: nn.Module, batch: PaddedBatch, num_loss_tokens: int) -> Float[Tensor, ""]:
    """The token-level policy-gradient loss of one padded micro-batch: ``-ratio · advantage`` summed over its
    loss tokens, divided by the step's loss tokens."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
    logprobs = logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logprobs - batch.inference_logprobs[:, 1:])
    per_token = -ratio * batch.advantages[:, None] * batch.loss_mask[:, 1:]
    return per_token.sum() / num_loss_tokens


def plain_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[PaddedBatch],
    num_loss_tokens: int,
    max_norm: float,
) -> dict[str, float]:
    """One optimizer step of the plain loop; returns its loss and gradient norm (before clipping)."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss = plain_loss(model, batch, num_loss_tokens)
        loss.backward()
        total += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return {"loss": total, "grad_norm": grad_norm.item()}


def attention_useful_share(samples: list[Sample], evaluated_pairs: int) -> float:
    """The share of the query-key pairs a dense attention evaluates that the samples need, a token attending
    only within its own sample: ``Σ len(sample)² / evaluated_pairs`` (rows × length² per micro-batch)."""
    return sum(len(s.token_ids) ** 2 for s in samples) / evaluated_pairs


def adamw(model: nn.Module, config: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, as the trainer makes it."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.optim.lr,
        betas=config.optim.betas,
        weight_decay=config.optim.weight_decay,
    )


def trident_side(
    config: TrainerConfig, world: World, samples: list[Sample]
) -> tuple[Callable[[], dict[str, float]], dict]:
    """The trainer's step on ``samples`` packed into micro-batches, and the padding statistics of that packing."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, world, config.optim.offload)
    optimizer = adamw(model, config)
    micro_batches = [MicroBatch.pack(bin) for bin in pack_samples(samples, config.seq_len)]
    info = batch_info(samples)
    positions = sum(m.input_ids.numel() for m in micro_batches)
    padding = positions - info.num_tokens
    assert padding == 0, f"packed micro-batches hold {padding} positions that are not sample tokens"
    stats = {
        "micro_batches": len(micro_batches),
        "positions": positions,
        "padding_share": padding / positions,
        "fill": info.num_tokens / (len(micro_batches) * config.seq_len),
        "attention_useful_share": attention_useful_share(samples, sum(m.input_ids.numel() ** 2 for m in micro_batches)),
    }

    def step() -> dict[str, float]:
        return train_step(model, optimizer, rank_share(micro_batches, world), info, config, world)

    return step, stats


def plain_side(config: TrainerConfig, samples: list[Sample]) -> tuple[Callable[[], dict[str, float]], dict]:
    """The plain loop's step on ``samples`` in padded micro-batches, and the padding statistics of those."""
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(config.model.name, dtype=torch.float32).train()
    optimizer = adamw(model, config)
    size = plain_batch_size(samples, config.seq_len)
    pad_id = model.config.pad_token_id
    batches = [pad_samples(samples[i : i + size], pad_id) for i in range(0, len(samples), size)]
    info = batch_info(samples)
    positions = sum(b.input_ids.numel() for b in batches)
    stats = {
        "micro_batches": len(batches),
        "samples_per_micro_batch": size,
        "positions": positions,
        "padding_share": (positions - info.num_tokens) / positions,
        "attention_useful_share": attention_useful_share(
            samples, sum(b.input_ids.shape[0] * b.input_ids.shape[1] ** 2 for b in batches)
        ),
    }

    def step() -> dict[str, float]:
        return plain_step(model, optimizer, batches, info.num_loss_tokens, config.optim.max_norm)

    return step, stats


def alternate(
    steps: dict[str, Callable[[], dict[str, float]]], repetitions: int
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[float]]]]:
    """One warm-up step per side (its metrics are returned), then ``repetitions`` timed steps per side,
    alternating, with the order swapped every repetition so that drift in the machine's load hits both.

    Steps are timed on both clocks: ``seconds[clock][side]`` lists one duration per repetition.
    """
    first = {name: step() for name, step in steps.items()}
    seconds = {clock: {name: [] for name in steps} for clock in CLOCKS}
    for repetition in range(repetitions):
        for name in list(steps) if repetition % 2 == 0 else list(reversed(steps)):
            starts = {clock: now() for clock, now in CLOCKS.items()}
            steps[name]()
            for clock, now in CLOCKS.items():
                seconds[clock][name].append(now() - starts[clock])
    return first, seconds


def speed_ratio(seconds: dict[str, list[float]]) -> dict:
    """Trident's speed over plain's on one clock: the ratio of the median step times, and the median of the ratios
    of each repetition's two adjacent steps (less sensitive to the machine's load drifting during the run)."""
    paired = [plain / trident for trident, plain in zip(seconds["trident"], seconds["plain"], strict=True)]
    return {
        "of_medians": statistics.median(seconds["plain"]) / statistics.median(seconds["trident"]),
        "paired_median": statistics.median(paired),
        "paired": paired,
    }


def agreement(first: dict[str, dict[str, float]]) -> dict:
    """Whether both sides' first steps (same weights, same data) computed the same loss and gradient norm."""
    trident, plain = first["trident"], first["plain"]

    def close(name: str) -> bool:
        return abs(trident[name] - plain[name]) <= 1e-5 + 1e-4 * abs(plain[name])

    return {
        "trident_loss": trident["loss"],
        "plain_loss": plain["loss"],
        "trident_grad_norm": trident["grad_norm"],
        "plain_grad_norm": plain["grad_norm"],
        "trident_bounded_fraction": trident["bounded_fraction"],  # plain has no ratio bounds: must be 0
        "same_loss": close("loss") and close("grad_norm") and trident["bounded_fraction"] == 0,
    }


def model_summary(model_dir: Path) -> dict:
    """The benchmark model's shape and parameter count."""
    config = AutoConfig.from_pretrained(model_dir)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return {key: getattr(config, key) for key in keys} | {"parameters": parameters}


def run_benchmark(bench: BenchmarkConfig, model_dir: Path) -> dict:
    """Both sides on the same model and data, side by side; the results as a JSON-able dict."""
    config = TrainerConfig(model={"name": str(model_dir)}, seq_len=bench.seq_len, seed=bench.seed)
    samples = rl_samples(bench, AutoConfig.from_pretrained(model_dir).vocab_size)
    info = batch_info(samples)
    world = init_world()
    try:
        built = {"trident": trident_side(config, world, samples), "plain": plain_side(config, samples)}
        first, seconds = alternate({name: step for name, (step, _) in built.items()}, bench.repetitions)
    finally:
        close_world()
    sides = {name: stats for name, (_, stats) in built.items()}
    for name, stats in sides.items():
        wall, cpu = seconds["wall"][name], seconds["cpu"][name]
        stats |= {
            "step_seconds": wall,
            "seconds_per_step": statistics.median(wall),
            "tokens_per_s": info.num_tokens / statistics.median(wall),
            "step_cpu_seconds": cpu,
            "cpu_seconds_per_step": statistics.median(cpu),
            "tokens_per_cpu_s": info.num_tokens / statistics.median(cpu),
        }
    return benchmark_result(
        "trainer_throughput",
        config=asdict(bench)
        | {"model": model_summary(model_dir), "threads": torch.get_num_threads(), "lr": config.optim.lr},
        data={"samples": info.num_samples, "tokens": info.num_tokens, "loss_tokens": info.num_loss_tokens},
        **sides,
        trident_over_plain={
            "tokens_per_s": speed_ratio(seconds["wall"]),
            "tokens_per_cpu_s": speed_ratio(seconds["cpu"]),
        },
        first_step=agreement(first),
    )


TABLE_COLUMNS = {  # title: (key of a side's results, format)
    "s/step": ("seconds_per_step", ".3f"),
    "tokens/s": ("tokens_per_s", ".0f"),
    "cpu s/step": ("cpu_seconds_per_step", ".3f"),
    "tokens/cpu-s": ("tokens_per_cpu_s", ".0f"),
    "micro-batches": ("micro_batches", "d"),
    "padding": ("padding_share", ".1%"),
    "attention used": ("attention_useful_share", ".1%"),
}


def summary_table(result: dict) -> str:
    """A few lines for the terminal."""
    rows = [f"{'':8}" + "".join(f"{title:>15}" for title in TABLE_COLUMNS)]
    for name in SIDES:
        rows.append(f"{name:8}" + "".join(f"{result[name][key]:>15{spec}}" for key, spec in TABLE_COLUMNS.values()))
    first = result["first_step"]
    for label, key in (("tokens/s", "tokens_per_s"), ("tokens/cpu-s", "tokens_per_cpu_s")):
        ratio = result["trident_over_plain"][key]
        rows.append(
            f"trident / plain {label}: {ratio['of_medians']:.2f} (median of paired steps: {ratio['paired_median']:.2f})"
        )
    rows += [
        f"packed fill: {result['trident']['fill']:.1%}",
        f"first-step loss: trident {first['trident_loss']:.6f}, plain {first['plain_loss']:.6f} "
        f"(same: {first['same_loss']})",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = benchmark_parser(__doc__, "trainer_throughput", "a tiny run (the tiny model, 8 short samples)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for both sides (1, as `rl` runs each process on CPU)"
    )
    args = parser.parse_args(argv)
    bench = SMOKE if args.smoke else FULL
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        model_dir = build_random_model(Path(tmp), bench.model_shape, bench.seed)
        result = run_benchmark(bench, model_dir)
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
