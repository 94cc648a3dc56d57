"""Benchmark: peak memory of the trainer's logprob and entropy computation, chunked against unchunked.

``uv run python benchmarks/logprob_memory.py`` (``--smoke``: a small vocabulary and few tokens).

Both sides take the same final hidden states of ``tokens`` positions and a random output layer of a Qwen3-sized
vocabulary (151,936), and compute what a training step needs from them: each position's logprob of its target
token after temperature, the entropy of that distribution (for the metrics, without gradient; the chunked side
computes it at the positions the trainer logs it for, ``logged_entropy_rows``), and the backward
of a policy-gradient-like loss (``-Σ advantage · logprob``) into the hidden states and the output layer.

- **chunked** is Trident's :func:`trainer.scoring.chunked_scores`: the logits of ``chunk_rows`` positions at a
  time, recomputed in the backward pass.
- **unchunked** is the computation Trident ran before: the ``[tokens × vocab]`` logits at once,
  ``log_softmax`` and ``gather`` for the logprobs, and the entropy from the same full tensor.

Each side runs in a fresh child process, so that its peak resident memory is its own: the peak is reset once
the inputs are made, and the peak above what the process held then is reported (0 below the resolution of a
page; a ratio counts such a peak as 1 MiB). The children also write their
logprobs, entropies (at the logged positions) and gradients, which must agree.
"""

import multiprocessing
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import benchmark_result, reset_peak_rss, rss_mib, run_and_report

from trainer.scoring import ScoreRequest, chunk_rows, chunked_scores, logged_entropy_rows

TEMPERATURE = 0.7
SIDES = ("chunked", "unchunked")


@dataclass(frozen=True)
class BenchmarkConfig:
    vocab_size: int
    hidden_size: int
    tokens: int
    seed: int = 0


FULL = BenchmarkConfig(vocab_size=151_936, hidden_size=1024, tokens=8192)
SMOKE = BenchmarkConfig(vocab_size=4096, hidden_size=64, tokens=512)


def inputs(config: BenchmarkConfig) -> tuple[torch.Tensor, ...]:
    """Hidden states, output layer, targets and advantages, the same on both sides."""
    generator = torch.Generator().manual_seed(config.seed)
    hidden = torch.randn(config.tokens, config.hidden_size, generator=generator).requires_grad_()
    weight = (torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.05).requires_grad_()
    targets = torch.randint(0, config.vocab_size, (config.tokens,), generator=generator)
    advantages = torch.randn(config.tokens, generator=generator)
    return hidden, weight, targets, advantages


def unchunked(hidden, weight, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole ``[tokens × vocab]`` logits at once (the trainer's computation before chunking)."""
    logits = (hidden @ weight.T).float() / TEMPERATURE
    logprobs = logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, -1)
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1)
        entropies = -(logp.exp() * logp).sum(-1)
    return logprobs, entropies


def chunked(hidden, weight, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Trident's chunked scoring."""
    scores = chunked_scores(hidden, weight, None, ScoreRequest(targets, TEMPERATURE, "logged"))
    return scores[:, 0], scores[:, 1]


def measure(side: str, config: BenchmarkConfig, output: Path, queue) -> None:
    """In a child process: one forward and backward of ``side``; puts its peak memory and seconds on ``queue``
    and saves its outputs to ``output``."""
    torch.set_num_threads(1)
    hidden, weight, targets, advantages = inputs(config)
    baseline = reset_peak_rss()
    start = time.process_time()
    logprobs, entropies = (chunked if side == "chunked" else unchunked)(hidden, weight, targets)
    (-(advantages * logprobs).sum()).backward()
    seconds = time.process_time() - start
    peak = rss_mib("VmHWM")
    logged = entropies.detach()[logged_entropy_rows(len(entropies))]
    torch.save({"logprobs": logprobs.detach(), "entropies": logged, "hidden_grad": hidden.grad,
                "weight_grad": weight.grad}, output)  # fmt: skip
    queue.put({"peak_mib": peak - baseline, "cpu_seconds": seconds})


def run_side(side: str, config: BenchmarkConfig, output: Path) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=measure, args=(side, config, output, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def run_benchmark(config: BenchmarkConfig) -> dict:
    sides, outputs = {}, {}
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        for side in SIDES:
            sides[side] = run_side(side, config, Path(tmp) / f"{side}.pt")
            outputs[side] = torch.load(Path(tmp) / f"{side}.pt")
    gaps = {
        name: (outputs["chunked"][name] - outputs["unchunked"][name]).abs().max().item() for name in outputs["chunked"]
    }
    logits_mib = config.tokens * config.vocab_size * 4 / 2**20
    return benchmark_result(
        "logprob_memory",
        config=asdict(config) | {"chunk_rows": chunk_rows(config.vocab_size), "one_fp32_logits_mib": logits_mib},
        **sides,
        unchunked_over_chunked_peak=max(sides["unchunked"]["peak_mib"], 1) / max(sides["chunked"]["peak_mib"], 1),
        max_abs_gap=gaps,
        same_values=all(gap <= 1e-4 for gap in gaps.values()),
    )


def summary_table(result: dict) -> str:
    rows = [f"{'':10}{'peak MiB':>12}{'CPU s':>10}"]
    rows += [f"{side:10}{result[side]['peak_mib']:>12.0f}{result[side]['cpu_seconds']:>10.2f}" for side in SIDES]
    rows.append(f"unchunked / chunked peak memory: {result['unchunked_over_chunked_peak']:.1f}x")
    rows.append(f"same values and gradients: {result['same_values']} (max gaps {result['max_abs_gap']})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    return run_and_report(
        argv, __doc__, "logprob_memory", "a small vocabulary and 512 tokens",
        lambda smoke: run_benchmark(SMOKE if smoke else FULL), summary_table,
    )  # fmt: skip


if __name__ == "__main__":
    main()
