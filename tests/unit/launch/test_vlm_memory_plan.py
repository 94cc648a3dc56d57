"""The memory plan of a vision-language model (Qwen3-VL): its vision tower's parameters against the model
transformers builds, its activations against what a bf16 tower keeps for the backward pass, and the trainer's plan
with the tower frozen (the default) or trained."""

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from contracts.model_card import GIB, ModelShape
from trainer.config import TrainerConfig
from trainer.plan import trainer_plan, vision_activation_bytes, vision_block_activation_bytes

TEXT = {"vocab_size": 300, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}  # fmt: skip
VISION = {"depth": 2, "hidden_size": 256, "intermediate_size": 768, "num_heads": 4, "patch_size": 16,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128, "num_position_embeddings": 64,
          "deepstack_visual_indexes": [1]}  # fmt: skip


def qwen3_vl(tie: bool = True) -> tuple[Qwen3VLConfig, Qwen3VLForConditionalGeneration]:
    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return config, Qwen3VLForConditionalGeneration(config)


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_counts_are_the_models(tie):
    config, model = qwen3_vl(tie)
    shape = ModelShape.from_config(config.to_dict())
    assert shape.vision_parameters == sum(p.numel() for p in model.model.visual.parameters())
    real = {p.data_ptr(): p.numel() for p in model.parameters()}  # tied weights once
    norms = sum(p.numel() for name, p in model.named_parameters() if "q_norm" in name or "k_norm" in name)
    assert shape.parameters == sum(real.values()) - norms  # the plan leaves out Qwen3's q/k norms


def saved_patch_bytes(tower, patches_high: int, saved_for_backward) -> int:
    """Bytes a bf16 vision tower keeps for the backward pass over one image of ``patches_high × 32`` patches."""
    pixels = torch.randn(patches_high * 32, VISION["temporal_patch_size"] * 3 * 16 * 16, dtype=torch.bfloat16)
    with saved_for_backward(tower) as saved:
        tower(pixels, grid_thw=torch.tensor([[1, patches_high, 32]]))
    return sum(saved.values())


def test_a_trained_towers_activations_are_what_it_saves_for_backward(saved_for_backward):
    _, model = qwen3_vl()
    tower = model.model.visual.to(torch.bfloat16)
    tower.set_attn_implementation("sdpa")  # as the trainer runs it
    measured = saved_patch_bytes(tower, 64, saved_for_backward) - saved_patch_bytes(tower, 32, saved_for_backward)
    tokens = 32 * 32 // 4  # the image tokens of the 32 × 32 patches added
    planned = vision_activation_bytes(ModelShape.from_config(qwen3_vl()[0].to_dict()).vision, tokens, 2, trained=True)
    embeddings = tokens * 2 * VISION["out_hidden_size"] * 2  # held for the language model, not saved for backward
    assert planned - embeddings == pytest.approx(measured, rel=0.05)


def test_the_trainer_plan_counts_the_tower_and_its_gradients_only_where_it_trains(tmp_path):
    config, _ = qwen3_vl()
    shape = ModelShape.from_config(config.to_dict())
    plans = {tower: trainer_plan(shape, TrainerConfig(model={"vision_tower": tower}, seq_len=2048), 1, gpu=False)
             for tower in ("frozen", "trained")}  # fmt: skip
    vision = shape.vision_parameters * 4 / GIB  # float32 bytes
    frozen, trained = plans["frozen"], plans["trained"]
    assert frozen["weights"] == pytest.approx(trained["weights"])  # float32 master weights either way
    assert trained["gradients"] - frozen["gradients"] == pytest.approx(vision)
    assert trained["optimizer"] - frozen["optimizer"] == pytest.approx(2 * vision)
    patches = 2048 * 4  # every token of the micro-batch an image token, of 2 × 2 patches
    block = vision_block_activation_bytes(shape.vision, 4)
    assert frozen["vision"] * GIB == 2048 * 2 * 128 * 4 + patches * block  # one block at a time, and the embeddings
    assert trained["vision"] > VISION["depth"] * frozen["vision"]
    text = ModelShape.from_config(TEXT | {"tie_word_embeddings": True})
    assert "vision" not in trainer_plan(text, TrainerConfig(seq_len=2048), 1, gpu=False)
