"""The trainer's config (``uv run trainer @ train.toml``)."""

from pathlib import Path
from typing import Annotated

from pydantic import Field

from rl.config import BaseConfig
from rl.shared_config import MaxSteps, ModelConfig, OutputDir, Seed, SeqLen, StrictModel


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
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    output_dir: OutputDir = Path("outputs")
    max_steps: MaxSteps = 20
    seq_len: SeqLen = 2048
    seed: Seed = 0
    batch_timeout_s: Annotated[
        float, Field(gt=0, description="Seconds to wait for the orchestrator's batch of a step before failing.")
    ] = 600.0
