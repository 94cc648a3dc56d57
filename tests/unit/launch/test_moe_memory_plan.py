"""The memory plan of a mixture of experts under expert parallelism, on Qwen3-30B-A3B: its parameter and adapter
counts against a model of its shape that transformers and peft build on the meta device, the per-rank split of what
expert parallelism shards, the EP degrees that fit an 80 GiB GPU, one-line refusals, and docs/moe.md's table."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from contracts.config import ConfigError, parse_config
from contracts.model_card import GIB, KNOWN_SHAPES, ModelShape, lora_parameters
from launch.launcher import run
from launch.memory_plan import plan_memory, size
from launch.rl_config import RLConfig, resolve_shared
from trainer.config import LoraConfig, TrainerConfig
from trainer.model import add_lora, use_packed_forward
from trainer.plan import trainer_plan

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Qwen3-30B-A3B's config.json, its shape
QWEN3_30B_A3B = {"vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False}  # fmt: skip
LAYERS = QWEN3_30B_A3B["num_hidden_layers"]
GPUS = list(range(8))  # the table's trainer: eight 80 GiB GPUs
LORA = {"rank": 8, "target_modules": SEVEN}  # on attention and on every expert


def counted(layers: int, lora: dict | None = None) -> tuple[int, int]:
    """(all, routed experts') parameters of a ``layers``-layer model of Qwen3-30B-A3B's shape built on the meta
    device (no memory), without Qwen3's q/k norms, which the plan leaves out; under ``lora`` the adapter's."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**QWEN3_30B_A3B | {"num_hidden_layers": layers}))
    if lora is not None:
        model = add_lora(model, LoraConfig(**lora))
    named = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad and not n.endswith("q_norm.weight")
             and not n.endswith("k_norm.weight")]  # fmt: skip
    return sum(n for _, n in named), sum(n for name, n in named if ".experts." in name)


def scaled(lora: dict | None = None) -> tuple[int, int]:
    """:func:`counted` for all 48 layers, from a 1- and a 2-layer model: the root plus 48 times one layer."""
    (one, experts), (two, _) = counted(1, lora), counted(2, lora)
    layer = two - one
    return one - layer + LAYERS * layer, LAYERS * experts


def model(ep: int, lora: dict | None) -> dict:
    return {"name": "Qwen/Qwen3-30B-A3B", "ac": {"freq": 1}, "parallel": {"ep": ep}} | (
        {"experimental": {"lora": lora}} if lora else {})  # fmt: skip


def plan(ep: int, lora: dict | None, gpus: list[int] = GPUS):
    return plan_memory(TrainerConfig(model=model(ep, lora), seq_len=8192), None, gpus, [], gpu_gib=80.0)


def test_qwen3_30b_a3b_counts_all_its_experts():
    shape = ModelShape.from_config(QWEN3_30B_A3B)
    assert shape == ModelShape.from_config(Qwen3MoeConfig(**QWEN3_30B_A3B).to_dict())  # num_local_experts there
    assert shape == KNOWN_SHAPES["Qwen3-30B-A3B"]
    assert round(shape.parameters / 1e9, 1) == 30.5  # its model card: 30.5B in total (3.3B activated)
    lora = {"rank": 4, "target_modules": SEVEN}
    trainer = TrainerConfig(model={"name": "Qwen/Qwen3-30B-A3B", "ac": {"freq": 1}, "experimental": {"lora": lora}})
    plan = trainer_plan(shape, trainer, ranks=1, gpu=True)
    adapter = lora_parameters(shape, SEVEN, 4)  # 245M: rank 4 on each of the 128 experts of 48 layers
    assert plan["weights"] == pytest.approx((30.53e9 * 2 + adapter * 4) / GIB, rel=0.01)  # every expert, in bf16


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_the_plans_counts_are_a_model_of_its_shape_built_by_transformers(lora):
    shape = KNOWN_SHAPES["Qwen3-30B-A3B"]
    parameters, experts = scaled()
    assert (shape.parameters, shape.expert_parameters) == (parameters, experts)  # 30.5B, of them 29.0B in experts
    trainable, _ = scaled(lora) if lora else (parameters, experts)
    if lora:
        assert lora_parameters(shape, SEVEN, 8) == trainable  # 497M, 491M of it on the experts
    for ep in (1, 2, 8):
        # everything over all eight ranks: expert parallelism splits the experts over ep ranks, and FSDP splits
        # a rank's share further over the 8 / ep ranks holding the same experts
        per_rank = trainable / 8
        frozen = parameters / 8 * 2 if lora else 0  # bf16 base
        trainer = plan(ep, lora).trainer
        assert trainer["gradients"] * GIB == pytest.approx(4 * per_rank)  # float32
        assert trainer["optimizer"] * GIB == pytest.approx(8 * per_rank)  # AdamW's two moments
        assert trainer["weights"] * GIB == pytest.approx(frozen + 4 * per_rank)


def test_expert_parallelism_adds_its_dispatch_buffers_and_lora_its_folded_experts():
    full, lora = plan(8, None).trainer, plan(8, LORA).trainer
    # 8,192 tokens, each sent to 8 experts: the dispatch's send and receive buffers of 2,048 bf16 values a copy
    assert full["all_to_all"] * GIB == 2 * 8192 * 8 * 2048 * 2
    assert "all_to_all" not in plan(1, None).trainer and "lora_experts" not in full
    # LoRA folds into this rank's 16 experts' gate_up (1,536 x 2,048) and down (2,048 x 768) weights: one bf16
    # copy kept for the recomputed layer, one its gradient (every layer is checkpointed)
    assert lora["lora_experts"] * GIB == 2 * 16 * (1536 * 2048 + 2048 * 768) * 2
    assert plan(1, LORA).trainer["lora_experts"] == pytest.approx(8 * lora["lora_experts"])  # all 128 experts
    attention_only = plan(8, {"rank": 8, "target_modules": SEVEN[:4]}).trainer
    assert "lora_experts" not in attention_only and attention_only["gradients"] < lora["gradients"] / 30


def test_the_ep_degrees_that_fit_eight_80_gib_gpus():
    fits = {(kind, ep): not plan(ep, lora).problems() for kind, lora in (("full", None), ("lora", LORA))
            for ep in (1, 2, 8)}  # fmt: skip
    # full training: 16 bytes a parameter fit split over eight ranks, whatever the ep
    assert fits == {(kind, ep): True for kind in ("full", "lora") for ep in (1, 2, 8)}
    # not on four: 30.5B x 16 bytes / 4 = 114 GiB a rank
    four = plan_memory(TrainerConfig(model={"name": "Qwen/Qwen3-30B-A3B", "parallel": {"ep": 2}}), None,
                       [0, 1, 2, 3], [], gpu_gib=80.0)  # fmt: skip
    assert four.problems() and four.problems()[0].startswith("GPU 0: trainer "), four.problems()
    assert plan(8, None).lines()[1].startswith("  trainer, per rank (ep 8: 16 of 128 experts a rank): 63.8 GiB")


def table_row(kind: str, ep: int, lora: dict | None) -> str:
    """A row of docs/moe.md's table, from the plan."""
    trainer = plan(ep, lora).trainer
    parts = ("weights", "gradients", "optimizer", "gathered", "lora_experts", "all_to_all")
    cells = [size(trainer[part]) if part in trainer else "-" for part in parts]
    working = size(trainer["activations"] + trainer["backward"] + trainer["allocator"] + trainer["cuda"])
    fits = "fits" if not plan(ep, lora).problems() else "refused"
    return f"| {kind} | {ep} | {128 // ep} | {' | '.join(cells)} | {working} | {size(trainer['total'])} | {fits} |"


def test_docs_table_is_the_plan():
    docs = (Path(__file__).parents[3] / "docs" / "moe.md").read_text()
    for kind, lora in (("full", None), ("LoRA rank 8", LORA)):
        for ep in (1, 2, 8):
            row = table_row(kind, ep, lora)
            assert row in docs, f"docs/moe.md lacks (or has another) row: {row}"


def test_rl_dry_run_shows_the_ep_degree_and_refuses_one_that_does_not_divide_the_ranks(capsys, tmp_path):
    """``rl --dry-run`` on the debug configs with Qwen3-30B-A3B on eight 80 GiB GPUs, in this process."""
    debug = Path(__file__).parents[3] / "configs" / "debug" / "rl"
    flags = ["--trainer", "@", str(debug / "train.toml"), "--orchestrator", "@", str(debug / "orch.toml"),
             "--inference", "@", str(debug / "infer.toml"), "--gpu-memory-gib", "80", "--model.name",
             "Qwen/Qwen3-30B-A3B", "--trainer-gpu-ids", "0,1,2,3,4,5,6,7", "--inference-gpu-ids", "8",
             "--trainer.model.ac.freq", "1", "--seq-len", "8192"]  # fmt: skip

    def rl_dry_run(ep: int, output_dir: Path) -> int:
        config = parse_config(
            RLConfig, [*flags, "--trainer.model.parallel.ep", str(ep), "--output-dir", str(output_dir)]
        )
        config = resolve_shared(config)
        config.dry_run = True
        return run(config)

    assert rl_dry_run(8, tmp_path / "ep8") == 0
    assert "  trainer, per rank (ep 8: 16 of 128 experts a rank): 63.8 GiB (" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"^trainer.model.parallel.ep = 3 must divide the trainer's ranks"):
        rl_dry_run(3, tmp_path / "ep3")
    assert not (tmp_path / "ep3").exists()  # refused before anything was written


@pytest.mark.parametrize("targets", [SEVEN, SEVEN[:4]], ids=["attention-and-experts", "attention"])
def test_lora_on_experts_keeps_one_folded_copy_of_them_for_backward(targets, layer_saved_bytes):
    """What a bf16 Qwen3-MoE layer under LoRA saves for the backward pass beyond its per-token activations (read with
    saved_tensors_hooks at two lengths): with the experts adapted, one copy of them with the adapter folded in, what
    the plan's ``lora_experts`` counts a copy; with attention alone adapted, nothing."""
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=96)  # fmt: skip
    torch.manual_seed(0)
    model = use_packed_forward(AutoModelForCausalLM.from_config(config)).requires_grad_(False)
    model = add_lora(model, LoraConfig(rank=4, target_modules=targets)).to(torch.bfloat16)
    base = model.get_base_model()

    short, long = layer_saved_bytes(model, base, 256), layer_saved_bytes(model, base, 512)
    beside_tokens = short - (long - short)  # what does not grow with the tokens
    # a checkpointed layer: the plan counts two copies, the recomputed layer's and its gradient
    lora = {"rank": 4, "target_modules": targets}
    trainer = TrainerConfig(model={"name": "tiny-moe", "ac": {}, "experimental": {"lora": lora}})
    plan = trainer_plan(ModelShape.from_config(config.to_dict()), trainer, ranks=1, gpu=True)
    copy = plan.get("lora_experts", 0) * GIB / 2  # 8 × (192 × 256 + 256 × 96) bf16 values with the experts adapted
    assert beside_tokens == pytest.approx(copy, abs=64)
