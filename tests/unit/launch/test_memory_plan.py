"""The memory plan ``rl`` makes before a run: parameter, adapter and activation bytes against real models and what an
H200 held, the weight broadcast's buffers, full training, QLoRA. ``rl --dry-run`` printing and refusing a plan is
checked in tests/integration/test_memory_plan_cli.py."""

import json
import statistics
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from contracts.errors import TridentError
from contracts.model_card import GIB, KNOWN_SHAPES, ModelShape, lora_parameters
from inference.config import InferenceConfig
from launch.memory_plan import plan_memory
from trainer.config import LoraConfig, TrainerConfig, TrainerModelConfig
from trainer.model import add_lora, load_model, use_packed_forward
from trainer.plan import ALLOCATOR_SLACK, CUDA_CONTEXT_GIB, layer_activation_bytes, trainer_plan

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_parameter_counts_are_the_models(tiny_model_path):
    shape = ModelShape.from_config(json.loads((Path(tiny_model_path) / "config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    real = {p.data_ptr(): p.numel() for p in model.parameters()}  # tied weights once
    norms = sum(p.numel() for name, p in model.named_parameters() if "q_norm" in name or "k_norm" in name)
    assert shape.parameters == sum(real.values()) - norms  # the plan leaves out Qwen3's q/k norms (2 × head_dim)
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    adapted = load_model(TrainerModelConfig(name=tiny_model_path, experimental={"lora": lora}), torch.device("cpu"))
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert lora_parameters(shape, lora["target_modules"], 4) == trainable
    assert round(KNOWN_SHAPES["Qwen3-8B"].parameters / 1e9, 2) == 8.19  # Qwen3-8B's model card: 8.2B


def real_parameters(model: torch.nn.Module) -> int:
    """A model's parameters, tied ones once, without Qwen3's q/k norms (which the plan leaves out)."""
    real = {p.data_ptr(): p.numel() for p in model.parameters()}
    return sum(real.values()) - sum(p.numel() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n)


TINY_MOE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # fmt: skip


@pytest.mark.parametrize(
    "config, sparse_layers",
    [
        (Qwen3MoeConfig(**TINY_MOE, mlp_only_layers=[1]), 2),  # routed experts and the router; layer 1 dense
        (Qwen2MoeConfig(**TINY_MOE, shared_expert_intermediate_size=48, decoder_sparse_step=2), 1),  # shared expert
    ],
    ids=["qwen3_moe", "qwen2_moe"],
)
def test_moe_parameter_counts_are_the_models(config, sparse_layers):
    shape = ModelShape.from_config(config.to_dict())
    model = AutoModelForCausalLM.from_config(config)
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_proj.bias"))  # Qwen2's q/k/v
    assert shape.parameters == real_parameters(model) - biases
    assert shape.sparse_layers == sparse_layers


def test_lora_on_moe_adapts_the_experts_as_peft_does():
    config = Qwen3MoeConfig(**TINY_MOE)
    shape = ModelShape.from_config(config.to_dict())
    for targets in (SEVEN, ["q_proj", "down_proj"], ["gate_proj", "up_proj"]):
        adapted = add_lora(AutoModelForCausalLM.from_config(config), LoraConfig(rank=4, target_modules=targets))
        trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        assert lora_parameters(shape, targets, 4) == trainable, targets


def test_a_lora_target_on_moe_experts_peft_cannot_adapt_is_one_line():
    """The fused expert weights count as targets (above); a name the model lacks, or one half of ``gate_up_proj``,
    is one line (peft raised a traceback for the latter)."""
    lacking = "no linear layer 'qproj' in the qwen3_moe model; its linear layers: down_proj, gate_proj, gate_up_proj"
    half = "Cannot convert PEFT target(s) gate_proj without also targeting up_proj"
    for targets, message in ((["q_proj", "qproj"], lacking), (["gate_proj"], half)):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**TINY_MOE))
        with pytest.raises(TridentError) as error:
            add_lora(model, LoraConfig(rank=4, target_modules=targets))
        assert str(error.value).startswith(f"model.experimental.lora.target_modules: {message}"), str(error.value)


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activations_are_what_a_layer_saves_for_backward(full, moe, layer_saved_bytes):
    """The per-token bytes of a bf16 decoder layer's saved tensors, read with saved_tensors_hooks at two lengths."""
    shape = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
    config = Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96) if moe else (
        AutoConfig.for_model("qwen3", **shape))  # fmt: skip
    torch.manual_seed(0)
    model = use_packed_forward(AutoModelForCausalLM.from_config(config))  # Trident's attention, as the trainer's
    if not full:
        model.requires_grad_(False)
        model = add_lora(model, LoraConfig(rank=4, target_modules=SEVEN))
    model = model.to(torch.bfloat16)  # as FSDP's mixed precision computes, adapter included
    base = model.get_base_model() if not full else model

    measured = (layer_saved_bytes(model, base, 1024) - layer_saved_bytes(model, base, 512)) / 512
    planned = layer_activation_bytes(ModelShape.from_config(config.to_dict()), 2, full, sparse=moe)
    assert planned == pytest.approx(measured, rel=0.05 if moe else 0.01)  # MoE: routing varies, index tensors


# What a trainer process held on one H200, by benchmarks/gpu_check.py on 2026-11-26 (torch 2.11, transformers 5.19,
# peft 0.21.2; random weights; one packed micro-batch; benchmarks/results/gpu_check_history.json, its three runs):
# (tokens, peak allocated, peak reserved by PyTorch, device memory held = reserved + CUDA context from
# torch.cuda.mem_get_info), GiB. The plan's two GPU constants were fitted to the Qwen3-0.6B rows alone; the Qwen3-8B
# rows are held out: no constant of the plan was fitted to them, and only they check the plan.
QWEN3_8B_LORA = {"ac": {"freq": 1}, "experimental": {"lora": {"rank": 4, "alpha": 8, "target_modules": SEVEN}}}
QWEN3_06B_FULL = {"reshard_after_forward": True}  # each layer resharded after forward, as FSDP2 did by default then
# Fitted: a Qwen3-0.6B-shaped full fine-tune without checkpointing, 8 samples of 1,024 and 64 of 128 tokens; the
# per-sample SDPA loop (baseline), varlen attention (new, first and third run).
FITTED_06B_ROWS = [(8192, 24.23, 28.15, 29.44), (8192, 24.23, 28.67, 29.96), (8192, 23.35, 28.10, 29.38),
                   (8192, 23.35, 27.98, 29.26), (8192, 24.44, 29.85, 31.13), (8192, 24.44, 29.74, 31.01)]  # fmt: skip
# Held out: a Qwen3-8B shape with LoRA rank 4 on all seven linears, checkpointing every layer, bf16 frozen base,
# 2,048-token samples; per-sample SDPA (baseline) and FlexAttention (new, first run).
HELD_OUT_8B_ROWS = [(8192, 22.32, 22.92, 24.22), (16_384, 26.51, 27.38, 28.68), (8192, 22.26, 22.89, 24.17),
                    (16_384, 26.39, 27.34, 28.69)]  # fmt: skip


def gpu_plan(name: str, model: dict, tokens: int) -> dict[str, float]:
    trainer = TrainerConfig(model={"name": f"Qwen/{name}", **model}, seq_len=tokens)
    return trainer_plan(KNOWN_SHAPES[name], trainer, ranks=1, gpu=True)


def test_the_gpu_constants_are_what_the_fitted_rows_give():
    """CUDA_CONTEXT_GIB: what the device held beyond PyTorch's reserve; ALLOCATOR_SLACK: what the caching allocator
    reserved beyond its peak allocation, as a share of the planned activations. Medians over the 0.6B rows only."""
    activations = gpu_plan("Qwen3-0.6B", QWEN3_06B_FULL, 8192)["activations"]
    context = statistics.median(used - reserved for _, _, reserved, used in FITTED_06B_ROWS)
    slack = statistics.median((reserved - allocated) / activations for _, allocated, reserved, _ in FITTED_06B_ROWS)
    assert CUDA_CONTEXT_GIB == pytest.approx(context, abs=0.05)  # 1.28 GiB measured; 1.25 planned
    assert ALLOCATOR_SLACK == pytest.approx(slack, abs=0.02)  # 0.30 measured


def test_plan_is_within_10_percent_of_what_the_h200_held_in_the_held_out_rows():
    for tokens, _, _, used in HELD_OUT_8B_ROWS:
        plan = gpu_plan("Qwen3-8B", QWEN3_8B_LORA, tokens)
        assert plan["total"] == pytest.approx(used, rel=0.10), (tokens, plan)  # 1.01-1.02 of it


# Measured after the fit, on one H100 by benchmarks/gpu_check.py on 2026-11-27 (torch 2.11; gpu_check.json): held
# out by construction. (tokens, device memory held) in GiB: Qwen3-0.6B full with every layer kept gathered (one GPU's
# default since the fit), eager and compiled; the Qwen3-8B LoRA case as above, compiled.
H100_ROWS = [("Qwen3-0.6B", {"reshard_after_forward": False}, 8192, used) for used in (30.23, 31.81, 31.87, 31.80)]
H100_ROWS += [("Qwen3-8B", QWEN3_8B_LORA, 8192, 24.13), ("Qwen3-8B", QWEN3_8B_LORA, 16_384, 28.68)]


def test_plan_is_within_10_percent_of_what_an_h100_held_after_the_fit():
    for name, model, tokens, used in H100_ROWS:
        plan = gpu_plan(name, model, tokens)
        assert plan["total"] == pytest.approx(used, rel=0.10), (name, tokens, plan)  # 1.00-1.06 of it


def test_the_copy_weight_deltas_are_taken_against_is_planned_on_the_cpu():
    shape = KNOWN_SHAPES["Qwen3-8B"]
    inference = InferenceConfig(model={"name": "Qwen/Qwen3-8B"}, gpu_memory_utilization=0.5)
    plain = TrainerConfig(model={"name": "Qwen/Qwen3-8B"})
    delta = TrainerConfig(model=plain.model, weights={"delta": "on"})
    cpu, cpu_delta = (plan_memory(t, inference, [], [], gpu_gib=None).trainer for t in (plain, delta))
    assert cpu_delta["delta_copy"] == pytest.approx(shape.parameters * 4 / GIB)  # float32 on the CPU
    assert cpu_delta["total"] == pytest.approx(cpu["total"] + cpu_delta["delta_copy"]) and "delta_copy" not in cpu
    assert "delta_copy" not in plan_memory(delta, inference, [0], [1], gpu_gib=80.0).trainer  # host memory


def test_the_weight_broadcast_buffers_are_planned_where_they_are_held():
    shape, lora = KNOWN_SHAPES["Qwen3-8B"], {"rank": 4, "target_modules": SEVEN, "export": "merged"}
    trainer = TrainerConfig(model={"name": "Qwen/Qwen3-8B", "experimental": {"lora": lora}}, weight_broadcast={})
    inference = InferenceConfig(model={"name": "Qwen/Qwen3-8B"}, gpu_memory_utilization=0.5)
    plan = plan_memory(trainer, inference, [0], [1], gpu_gib=80.0)
    # NCCL: the trainer moves one tensor at a time to its GPU (the largest, the embeddings, in bf16); the server
    # receives every tensor onto its GPU before loading them, beside vLLM's share
    assert plan.trainer["broadcast"] == pytest.approx(151_936 * 4096 * 2 / GIB)
    assert plan.inference["broadcast"] == pytest.approx(shape.parameters * 2 / GIB)
    assert plan.inference["total"] == pytest.approx(40.0 + shape.parameters * 2 / GIB)
    assert any(", 55.3 GiB in all" in line for line in plan.lines())
    gloo = TrainerConfig(model=trainer.model, weight_broadcast={"backend": "gloo"})
    assert "broadcast" not in plan_memory(gloo, inference, [0], [1], gpu_gib=80.0).trainer  # in host memory
    cpu = plan_memory(trainer, inference, [], [], gpu_gib=None)
    assert cpu.trainer["broadcast"] == pytest.approx(shape.parameters * 4 / GIB)  # float32 on the CPU
    assert cpu.inference["broadcast"] == pytest.approx(shape.parameters * 4 / GIB)
    assert "broadcast" not in plan_memory(TrainerConfig(model=trainer.model), inference, [0], [1], 80.0).trainer
    # one GPU for both (rl settles 'auto' to 'shared'): the trainer's buffer of full bf16 weights, the server's
    # worker copying from it into its parameters
    shared = TrainerConfig(model=trainer.model, weight_broadcast={"backend": "shared"})
    plan = plan_memory(shared, inference, [0], [0], gpu_gib=80.0)
    assert plan.trainer["broadcast"] == pytest.approx(shape.parameters * 2 / GIB)
    assert "broadcast" not in plan.inference


def test_full_training_of_8b_needs_its_optimizer_state_and_the_server_its_weights():
    trainer = TrainerConfig(model={"name": "Qwen/Qwen3-8B"}, seq_len=1024)
    plan = plan_memory(trainer, None, [0], [0], gpu_gib=80.0)
    # float32 master weights, gradients and AdamW's two moments: 16 bytes a parameter
    assert plan.trainer["weights"] + plan.trainer["gradients"] + plan.trainer["optimizer"] == pytest.approx(
        16 * 8.19e9 / 2**30, rel=1e-3
    )
    assert plan.problems() == [
        f"GPU 0: trainer {plan.trainer['total']:.1f} GiB = {plan.trainer['total']:.1f} GiB does not fit in its "
        f"80.0 GiB (trainer: {plan.describe('trainer')})"
    ]
    sharded = plan_memory(trainer, None, list(range(8)), [], gpu_gib=80.0)
    assert sharded.trainer["optimizer"] == pytest.approx(plan.trainer["optimizer"] / 8)
    assert sharded.problems() == []  # FSDP over 8 GPUs


def test_activations_are_planned_for_the_micro_batch_budget_and_the_checkpointed_part():
    shape = KNOWN_SHAPES["Qwen3-0.6B"]

    def plan(model: dict | None = None, **trainer) -> dict[str, float]:
        config = TrainerConfig(model={"name": "Qwen/Qwen3-0.6B", **(model or {})}, **trainer)
        return trainer_plan(shape, config, ranks=1, gpu=True)

    short, budget = plan(seq_len=1024), plan(seq_len=1024, micro_batch_tokens=8192)
    assert budget["activations"] == pytest.approx(8 * short["activations"])  # counted by the budget, not seq_len
    assert budget["activations"] == pytest.approx(plan(seq_len=8192)["activations"])
    ac = ({}, {"ac": {}}, {"ac": {"part": "mlp"}}, {"ac": {"part": "attention"}})
    full, layer, mlp, attention = (plan(model, seq_len=8192) for model in ac)
    # recomputing the whole layer keeps least, one of its parts less than no checkpointing
    assert layer["activations"] < min(mlp["activations"], attention["activations"])
    assert max(mlp["activations"], attention["activations"]) < full["activations"]
    # a checkpointed MLP keeps its 1024-wide bf16 input instead of its input, gate, up, activation and product
    per_token = 2 * 4 * 3072 * 28 * 8192 / GIB
    assert full["activations"] - mlp["activations"] == pytest.approx(per_token)


def test_one_gpu_of_full_training_keeps_every_layer_gathered():
    shape = KNOWN_SHAPES["Qwen3-0.6B"]

    def gathered(ranks: int, gpu: bool = True, **model) -> float:
        config = TrainerConfig(model={"name": "Qwen/Qwen3-0.6B", **model})
        return trainer_plan(shape, config, ranks=ranks, gpu=gpu)["gathered"]

    two_layers = (shape.root_parameters + 2 * shape.layer_parameters) * 2 / GIB  # bf16, resharded after forward
    assert gathered(1) == pytest.approx(shape.parameters * 2 / GIB)  # every layer kept, in bf16
    assert gathered(2) == pytest.approx(two_layers)
    assert gathered(1, experimental={"lora": {"rank": 4}}) == pytest.approx(two_layers)
    assert gathered(1, gpu=False) == pytest.approx(two_layers * 2)  # the CPU reshards, float32


def test_a_4bit_base_is_planned_at_the_bytes_bitsandbytes_holds(tiny_model_path):
    """QLoRA's weights: the tiny model's base with its linears in NF4 as loaded, plus the float32 adapter."""
    from bitsandbytes.nn import Linear4bit

    lora = {"rank": 4, "target_modules": SEVEN}
    config = TrainerConfig(model={"name": tiny_model_path, "experimental": {"lora": lora, "load_in_4bit": True}})
    model = load_model(config.model, torch.device("cpu"))
    held = sum({p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}.values())  # tied once
    for layer in (module for module in model.modules() if isinstance(module, Linear4bit)):
        state = layer.weight.quant_state  # its scales and code tables
        scales = (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code)
        held += sum(t.numel() * t.element_size() for t in scales)
    norms = sum(p.numel() * 4 for name, p in model.named_parameters() if "q_norm" in name or "k_norm" in name)
    plan = trainer_plan(ModelShape.from_config(model.config.to_dict()), config, ranks=1, gpu=False)
    assert plan["weights"] * GIB == held - norms  # Qwen3's q/k norms are left out (see above)
    assert plan["dequantized"] * GIB == 64 * 128 * 4  # the largest linear (gate/up/down: 64 × 128) in float32


def test_qlora_holds_llama_8b_at_about_half_a_byte_a_linear_weight():
    """Llama-3.1-8B in bf16 on a GPU, rank 16 on the seven linears, by hand: 6,979,321,856 weights in its linears
    (32 layers × (2 · 4096² + 2 · 4096 · 1024 + 3 · 4096 · 14,336)), 1,050,939,392 others (embeddings and output
    layer 2 × 128,256 × 4096, 65 norms of 4096)."""
    lora = {"rank": 16, "target_modules": SEVEN}
    model = {"name": "meta-llama/Llama-3.1-8B-Instruct", "experimental": {"lora": lora, "load_in_4bit": True}}
    plan = trainer_plan(KNOWN_SHAPES["Llama-3.1-8B-Instruct"], TrainerConfig(model=model), ranks=1, gpu=True)
    linears = 6_979_321_856
    # 4 bits a weight, an 8-bit scale per 64 and a float32 one per 256 × 64; an offset and code tables (273 float32)
    quantized = linears // 2 + linears // 64 + 4 * linears // (64 * 256) + 32 * 7 * 4 * 273
    adapter = 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18_432)  # rank × (in + out) of each linear
    assert plan["weights"] * GIB == quantized + 1_050_939_392 * 2 + adapter * 4
    assert 5.46 < plan["weights"] < 5.47  # GiB; in bf16 the base alone takes 14.96
    assert plan["optimizer"] * GIB == 2 * adapter * 4
    assert plan["dequantized"] * GIB == 4096 * 14_336 * 2  # one MLP linear in bf16
