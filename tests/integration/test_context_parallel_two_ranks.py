"""Context parallelism on two gloo ranks (one torchrun launch of tests/context_parallel_ranks.py): each micro-batch's
tokens split over both ranks (cp = 2) give the loss, statistics, gradients and updated weights of each rank holding
whole micro-batches (cp = 1), in full training and under LoRA with activation checkpointing, on packed rows with
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
    assert step["gradient_difference"].keys() == step["gradient"].keys()
    assert max(step["gradient_difference"].values()) < 1e-5
    # every trained tensor got a gradient (under LoRA its B matrices: A's is 0 at the first step, as B is 0)
    assert min(value for name, value in step["gradient"].items() if "lora_A" not in name) > 1e-6
    assert max(step["weight_difference"].values()) < 1e-5


@pytest.mark.slow
def test_a_resumed_context_parallel_run_equals_an_uninterrupted_one(runs):
    assert_resumed_equals_whole(runs / "whole", runs / "resumed", steps=3)
