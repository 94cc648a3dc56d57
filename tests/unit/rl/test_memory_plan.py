import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.launch.memory_plan import KNOWN_SHAPES, ModelShape, lora_parameters, plan_memory
from trainer.config import TrainerConfig, TrainerModelConfig
from trainer.model import load_model

ROOT = Path(__file__).parents[3]
SWE_GREP = ROOT / "configs" / "swe-grep" / "rl"


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


def rl_dry_run(tmp_path, *flags):
    argv = [sys.executable, "-m", "rl.launch.launcher", "--trainer", "@", str(SWE_GREP / "train.toml"),
            "--orchestrator", "@", str(SWE_GREP / "orch.toml"), "--inference", "@", str(SWE_GREP / "infer.toml"),
            "--output-dir", str(tmp_path), "--dry-run", *flags]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_swe_grep_fits_one_80_gb_gpu_and_an_oversize_config_is_refused(tmp_path):
    result = rl_dry_run(tmp_path / "fits", "--gpu-memory-gib", "80")
    assert result.returncode == 0, result.stderr
    assert "trainer, per rank: 20.5 GiB (weights 15.3 GiB," in result.stdout  # Qwen3-8B in bf16 beside its adapter
    assert "inference: 40.0 GiB claimed by vLLM" in result.stdout
    assert "GPU 0: trainer + inference = 60.5 GiB, free 19.5 GiB" in result.stdout

    result = rl_dry_run(tmp_path / "oversize", "--gpu-memory-gib", "80", "--inference.gpu-memory-utilization", "0.9")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "the run does not fit in memory: GPU 0: trainer 20.5 GiB + inference 72.0 GiB = 92.5 GiB does not fit " \
           "in its 80.0 GiB" in result.stderr  # fmt: skip
    assert not (tmp_path / "oversize").exists()  # refused before anything was written


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
