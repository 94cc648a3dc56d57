"""The trainer refuses at its start exactly what ``rl --dry-run`` refuses, from the same code (trainer.rules): each bad
config below goes through rl's dry run in this process and through the trainer's start check on as many ranks as rl
would start, and both stop with the same line (the key named as each one's config spells it), raised in
trainer/rules.py."""

from pathlib import Path

import pytest
import torch
from debug_configs import FILES

from contracts.config import parse_config
from launch.launcher import run
from launch.rl_config import RLConfig, resolve_shared, trainer_ranks
from tools.tiny_model import built_model_path
from trainer.config import TrainerConfig
from trainer.parallel import World
from trainer.rules import Refusal
from trainer.train import check_start

BAD = {
    "cp over the heads": ("trident/tiny-qwen3", ["--trainer.model.parallel.cp", "4"]),
    "cp on a mixture of experts": ("trident/tiny-qwen3-moe", ["--trainer.model.parallel.cp", "2"]),
    "cp on a vision-language model": ("trident/tiny-qwen3-vl", ["--trainer.model.parallel.cp", "2"]),
    "cp on a 4-bit base": (
        "trident/tiny-qwen3",
        ["--trainer.model.parallel.cp", "2", "--trainer.model.experimental", '{"load_in_4bit": true, "lora": {}}'],
    ),
    "ep on a dense model": ("trident/tiny-qwen3", ["--trainer.model.parallel.ep", "2"]),
    "ep over the experts": ("trident/tiny-qwen3-moe", ["--trainer.model.parallel.ep", "3"]),
    "a LoRA target the model lacks": (
        "trident/tiny-qwen3",
        ["--trainer.model.experimental.lora", '{"target_modules": ["qproj", "v_proj"]}'],
    ),
}


def rl_dry_run(model: str, flags: list[str], output_dir: Path) -> tuple[pytest.ExceptionInfo, int]:
    """How ``rl --dry-run`` on this machine (no GPU) refuses ``flags``, and the trainer's ranks it would start."""
    config = parse_config(RLConfig, [*FILES, "--model.name", model, "--output-dir", str(output_dir), *flags])
    ranks = trainer_ranks(config, on_gpu=False)
    config.dry_run = True
    with pytest.raises(Refusal) as refused:
        run(resolve_shared(config, on_gpu=False))
    return refused, ranks


def trainer_start(model: str, flags: list[str], ranks: int) -> pytest.ExceptionInfo:
    """How the trainer refuses the same flags (``--trainer.x`` is its own ``--x``) at its start on ``ranks`` ranks."""
    own = [flag.replace("--trainer.", "--") for flag in flags]
    config = parse_config(TrainerConfig, ["--model.name", model, *own])
    with pytest.raises(Refusal) as refused:
        check_start(config, World(0, ranks, torch.device("cpu"), cp=config.model.parallel.cp))
    return refused


@pytest.mark.parametrize(("model", "flags"), list(BAD.values()), ids=list(BAD))
def test_the_trainer_refuses_at_start_what_rl_refuses_from_the_same_code(model, flags, tmp_path):
    built_model_path(model)
    rl, ranks = rl_dry_run(model, flags, tmp_path)
    trainer = trainer_start(model, flags, ranks)
    assert str(trainer.value) == str(rl.value).replace("trainer.", "")
    for refused in (rl, trainer):
        assert Path(refused.traceback[-1].path).parts[-2:] == ("trainer", "rules.py")
