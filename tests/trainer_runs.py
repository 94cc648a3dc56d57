"""Short runs of the trainer on the tiny model for the checkpoint tests: 4 steps, a checkpoint every 2, and the loss
each step logged."""

import json

from trainer.config import TrainerConfig

SETTINGS = {"max_steps": 4, "optim": {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 1}, "batch_timeout_s": 1}


def config(output_dir, model_path, model=None, **ckpt) -> TrainerConfig:
    model = {"name": model_path, **(model or {})}
    return TrainerConfig(output_dir=output_dir, model=model, ckpt={"interval": 2, **ckpt}, **SETTINGS)


def losses(output_dir) -> dict[int, float]:
    lines = (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}
