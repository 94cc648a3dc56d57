import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[3]


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
