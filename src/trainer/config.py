"""The trainer's config (``uv run trainer @ train.toml``)."""

from pathlib import Path
from typing import Annotated

from pydantic import Field

from rl.config import BaseConfig
from rl.shared_config import MaxSteps, ModelConfig, OutputDir, Seed, SeqLen, StrictModel, WandbSection


class ActivationCheckpointConfig(StrictModel):
    freq: Annotated[
        int, Field(ge=1, description="Recompute the activations of every `freq`-th decoder layer in the backward pass.")
    ] = 1


class LoraConfig(StrictModel):
    rank: Annotated[int, Field(ge=1, description="Rank of the adapter matrices.")] = 8
    alpha: Annotated[float, Field(gt=0, description="Scale of the adapter's update is alpha / rank.")] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1, description="Dropout on the adapter's input.")] = 0.0
    target_modules: Annotated[
        list[str], Field(min_length=1, description="Names of the linear layers that get an adapter.")
    ] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    modules_to_save: Annotated[
        list[str], Field(description="Modules trained in full next to the adapter, e.g. 'lm_head'.")
    ] = []


class ExperimentalConfig(StrictModel):
    lora: Annotated[
        LoraConfig | None, Field(description="Train a LoRA adapter instead of all weights (absent: full training).")
    ] = None


class TrainerModelConfig(ModelConfig):
    ac: Annotated[
        ActivationCheckpointConfig | None,
        Field(description="Activation checkpointing: less memory for more compute (absent: off)."),
    ] = None
    experimental: ExperimentalConfig = ExperimentalConfig()


class OptimConfig(StrictModel):
    lr: Annotated[float, Field(gt=0, description="AdamW learning rate.")] = 1e-6
    betas: Annotated[tuple[float, float], Field(description="AdamW betas.")] = (0.9, 0.999)
    weight_decay: Annotated[float, Field(ge=0, description="AdamW decoupled weight decay.")] = 0.0
    max_norm: Annotated[float, Field(gt=0, description="Gradients are clipped to this global L2 norm.")] = 1.0


class LossConfig(StrictModel):
    mask_low: Annotated[
        float, Field(ge=0, description="Tokens whose importance ratio falls below this are masked out.")
    ] = 0.125
    mask_high: Annotated[
        float, Field(gt=0, description="Tokens whose importance ratio rises above this are masked out.")
    ] = 8.0


class TrainerConfig(BaseConfig):
    model: TrainerModelConfig = TrainerModelConfig()
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    output_dir: OutputDir = Path("outputs")
    max_steps: MaxSteps = 20
    seq_len: SeqLen = 2048
    seed: Seed = 0
    wandb: WandbSection = None
    batch_timeout_s: Annotated[
        float, Field(gt=0, description="Seconds to wait for the orchestrator's batch of a step before failing.")
    ] = 600.0
