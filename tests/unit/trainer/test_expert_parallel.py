"""Expert parallelism's parts on one rank: the dispatch and combine around the experts compute what transformers'
experts module computes, the grouped GEMM what the loop computes, and what cannot be split is refused in one line.
Two ranks, all-to-all included: tests/integration/test_expert_parallel_two_ranks.py."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from contracts.errors import TridentError
from tools.tiny_model import built_model_path
from trainer.moe.expert_parallel import ParallelExperts, expert_mesh, expert_mlps, split_experts

CONFIG = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def random_experts() -> Qwen3MoeExperts:
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(CONFIG)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    experts.config._experts_implementation = "eager"  # transformers' loop over experts
    return experts


def test_split_experts_compute_what_transformers_experts_compute(world):
    reference = random_experts()
    parallel = ParallelExperts(reference, expert_mesh(1, "cpu"))
    hidden = torch.randn(13, 64, requires_grad=True)
    selected = torch.randint(0, 4, (13, 2))
    selected[:, 1] = (selected[:, 0] + 1) % 4  # two different experts per token; expert 3 chosen by some only
    weights = torch.rand(13, 2, requires_grad=True)
    outputs, gradients = [], []
    for module in (reference, parallel):
        output = module(hidden, selected, weights)
        output.backward(torch.linspace(-1, 1, output.numel()).view_as(output))
        outputs.append(output.detach())
        gradients.append([hidden.grad, weights.grad, *(p.grad for p in module.parameters())])
        hidden.grad = weights.grad = None
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for got, expected in zip(gradients[1], gradients[0], strict=True):
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_grouped_gemm_computes_what_the_loop_computes():
    experts = random_experts()
    rows = torch.randn(11, 64, requires_grad=True)
    per_expert = torch.tensor([3, 0, 6, 2])  # an expert without rows too
    results = []
    for grouped in (False, True):
        output = expert_mlps(rows, per_expert, experts.gate_up_proj, experts.down_proj, experts.act_fn, grouped)
        output.backward(torch.linspace(-1, 1, output.numel()).view_as(output))
        results.append((output.detach(), rows.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
        rows.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_what_cannot_be_split_is_refused_in_one_line(world, tiny_model_path):
    with pytest.raises(TridentError, match=r"^model.parallel.ep = 2 must divide the trainer's 1 ranks$"):
        expert_mesh(2, "cpu")
    mesh = expert_mesh(1, "cpu")
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.raises(TridentError, match=r"^model.parallel.ep = 1: the qwen3 model has no mixture-of-experts layers"):
        split_experts(dense, mesh)
    moe = AutoModelForCausalLM.from_pretrained(built_model_path("trident/tiny-qwen3-moe"))
    adapted = get_peft_model(moe, LoraConfig(r=2, target_parameters=["experts.gate_up_proj"]))
    with pytest.raises(TridentError, match=r"a LoRA adapter on the experts' weights cannot be split over ranks"):
        split_experts(adapted, mesh)
