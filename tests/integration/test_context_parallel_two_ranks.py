"""Context parallelism on two gloo ranks (one torchrun launch of tests/context_parallel_ranks.py): each micro-batch's
tokens split over both ranks (cp = 2) give the loss, statistics, gradients and updated weights of each rank holding
whole micro-batches (cp = 1; gradients and weights per tensor, relative to its own scale), in full training and under LoRA with activation checkpointing, on packed rows with
samples longer and shorter than a shard; with per-sample SDPA (the CPU's attention) and with one varlen call per
layer (a GPU's, its kernel replaced by the documented stand-in); and a resumed cp = 2 run equals an uninterrupted
one."""

import json
from pathlib import Path

import pytest
from context_parallel_ranks import write_long_batches
from trainer_runs import assert_resumed_equals_whole, run_on_two_ranks

from contracts.sampling import Truncation
from tools.tiny_model import built_model_path

RANKS = Path(__file__).parents[1] / "context_parallel_ranks.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("context_parallel")
    built_model_path("trident/tiny-qwen3")
    assert write_long_batches(folder / "full", steps=1) == 4  # cp = 1: two micro-batches a rank
    write_long_batches(folder / "lora", steps=1, truncation=Truncation(top_p=0.95))
    for run in ("whole", "resumed"):
        write_long_batches(folder / run, steps=3)
    run_on_two_ranks(RANKS, folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("training", ["full", "lora", "varlen"])
def test_split_micro_batches_give_the_loss_statistics_and_gradients_of_whole_ones(runs, training):
    step = json.loads((runs / "steps.json").read_text())[training]
    whole, split = step["totals"]
    assert split.keys() == whole.keys()
    for name in whole:  # the loss and every statistic of the step, each token counted once
        assert split[name] == pytest.approx(whole[name], rel=1e-5, abs=1e-5), name
    assert whole["loss"] != 0 and whole["entropy"] > 0
    if training == "lora":  # the correction acted, the truncation kept most sampled tokens
        assert whole["corrected_tokens"] > 0 and "reference_kl" in whole
        assert whole["outside_kept_tokens"] < whole["entropy_tokens"] / 2
    # per tensor, relative to its own scale: the largest gradient difference over the tensor's largest gradient
    # (measured on two gloo ranks, worst of the three: 3.1e-7, float32 rounding; largest absolute 7.5e-9), and the
    # largest weight difference after the step over the step's largest change of that tensor (worst: 8.0e-4, full
    # training's embeddings, where Adam's first step lr·g/(|g| + 1e-8) magnifies rounding in gradients near 1e-8;
    # 3.4e-6 under LoRA)
    gradient, difference = step["gradient"], step["gradient_difference"]
    assert difference.keys() == gradient.keys()
    for name, largest in gradient.items():
        if "lora_A" in name:  # 0 at the first step (B is 0), in both runs
            assert largest == 0 and difference[name] == 0, name
        else:  # every other trained tensor got a gradient (the smallest largest one: 4.5e-4)
            assert largest > 1e-4 and difference[name] / largest < 1e-6, (name, largest, difference[name])
    update, weight_difference = step["update"], step["weight_difference"]
    assert weight_difference.keys() == update.keys()
    for name, change in update.items():  # weights the step leaves (frozen under LoRA) must be left in both runs
        assert weight_difference[name] <= 2e-3 * change, (name, change, weight_difference[name])


@pytest.mark.slow
def test_a_resumed_context_parallel_run_equals_an_uninterrupted_one(runs):
    assert_resumed_equals_whole(runs / "whole", runs / "resumed", steps=3)
