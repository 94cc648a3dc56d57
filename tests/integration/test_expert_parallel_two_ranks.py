"""Expert parallelism on two gloo ranks (one torchrun launch of tests/expert_parallel_ranks.py): the tiny MoE's experts
split over both ranks give the loss, gradients and exported weights of every rank holding all experts, and a resumed
expert-parallel run equals an uninterrupted one."""

import json
from pathlib import Path

import pytest
from batches import write_random_batches
from trainer_runs import assert_resumed_equals_whole, run_on_two_ranks

from tools.tiny_model import built_model_path

RANKS = Path(__file__).parents[1] / "expert_parallel_ranks.py"
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("expert_parallel")
    built_model_path("trident/tiny-qwen3-moe")
    for run in ("whole", "resumed"):  # three micro-batches: one rank also runs a zero-weight pass
        assert write_random_batches(folder / run, steps=3, num_samples=9) == 3
    run_on_two_ranks(RANKS, folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("training", ["full", "lora"])
def test_split_experts_give_the_loss_and_gradients_of_whole_ones(runs, training):
    step = json.loads((runs / "steps.json").read_text())[training]
    assert step["loss"][1] == pytest.approx(step["loss"][0], abs=1e-5)
    assert step["gradient_difference"].keys() == step["gradient"].keys()
    assert max(step["gradient_difference"].values()) < 1e-5
    expert_gradients = [value for name, value in step["gradient"].items() if name.endswith(EXPERTS)]
    assert len(expert_gradients) == (4 if training == "full" else 0)  # two layers' experts; frozen under LoRA
    assert all(value > 1e-4 for value in expert_gradients)  # they trained: the tokens reached them on both ranks
    # the weights the server gets (as files or by broadcast) hold every expert, updated as with ep = 1
    shapes = {name: shape for name, shape in step["weight_shapes"].items() if name.endswith(EXPERTS)}
    assert sorted(map(tuple, shapes.values())) == [(4, 64, 64)] * 2 + [(4, 128, 64)] * 2
    assert max(step["weight_difference"].values()) < 1e-5


@pytest.mark.slow
def test_a_resumed_expert_parallel_run_equals_an_uninterrupted_one(runs):
    expected = assert_resumed_equals_whole(runs / "whole", runs / "resumed", steps=3)
    experts = {name.split(".")[5] for name in expected if ".mlp.experts." in name}  # saved one tensor per expert
    assert experts == {"0", "1", "2", "3"}  # experts 0-1 held by rank 0, 2-3 by rank 1, gathered
