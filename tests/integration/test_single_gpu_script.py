import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]


@pytest.mark.skipif(shutil.which("uv") is None, reason="the script runs rl through uv")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_single_gpu_script_says_there_is_no_gpu_and_uses_the_tiny_model(tmp_path):
    env = os.environ | {"UV_NO_SYNC": "1"}  # the test session's environment is already installed
    result = subprocess.run(
        ["bash", "scripts/test_rl_single_gpu.sh", "--output-dir", str(tmp_path), "--dry-run"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no GPU found: running the same configs on the CPU with the tiny model" in result.stdout
    trainer = tomllib.loads((tmp_path / "configs" / "trainer.toml").read_text())
    inference = tomllib.loads((tmp_path / "configs" / "inference.toml").read_text())
    assert trainer["model"]["name"] == inference["model"]["name"] == "trident/tiny-qwen3"
    assert trainer["max_steps"] == 5 and trainer["model"]["experimental"]["lora"]["rank"] == 4
    assert inference["gpu_memory_utilization"] == 0.5


@pytest.mark.skipif(shutil.which("uv") is None, reason="the script runs rl through uv")
def test_single_gpu_script_gpu_branch_shares_gpu_0_and_its_plan_fits(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    # UV_NO_SYNC: `uv run --extra gpu` then installs nothing and runs rl from the test session's environment
    env = os.environ | {"UV_NO_SYNC": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    output_dir = tmp_path / "run"
    planned = ["--output-dir", str(output_dir), "--gpu-memory-gib", "80", "--dry-run"]  # an 80 GB GPU, for the plan
    result = subprocess.run(
        ["bash", "scripts/test_rl_single_gpu.sh", *planned],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "GPU found: GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0); inference and trainer share GPU 0" in result.stdout
    configs = output_dir / "configs"
    python = r"\S+python\S*"  # the environment's interpreter
    assert re.search(rf"^  inference: CUDA_VISIBLE_DEVICES=0 {python} -m inference.main @ {configs}/inference.toml$",
                     result.stdout, re.MULTILINE)  # fmt: skip
    assert re.search(rf"^  trainer: CUDA_VISIBLE_DEVICES=0 {python} -m trainer.main @ {configs}/trainer.toml$",
                     result.stdout, re.MULTILINE)  # fmt: skip
    assert "memory plan (GPUs of 80.0 GiB):" in result.stdout and "  GPU 0: trainer + inference = " in result.stdout
    assert "willcb/Qwen3-8B" in (configs / "trainer.toml").read_text()  # the GPU branch keeps the configs' model
