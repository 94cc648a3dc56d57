"""The memory plan as ``rl --dry-run`` prints it, run in a process of its own on the swe-grep configs: the run fits
one 80 GB GPU, and a config past it is refused before anything is written. The plan's numbers themselves are checked
in tests/unit/launch/test_memory_plan.py."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SWE_GREP = ROOT / "configs" / "swe-grep" / "rl"


def rl_dry_run(tmp_path, *flags):
    argv = [sys.executable, "-m", "launch.main", "--trainer", "@", str(SWE_GREP / "train.toml"),
            "--orchestrator", "@", str(SWE_GREP / "orch.toml"), "--inference", "@", str(SWE_GREP / "infer.toml"),
            "--output-dir", str(tmp_path), "--dry-run", *flags]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_swe_grep_fits_one_80_gb_gpu_and_an_oversize_config_is_refused(tmp_path):
    result = rl_dry_run(tmp_path / "fits", "--gpu-memory-gib", "80")
    assert result.returncode == 0, result.stderr
    assert "trainer, per rank: 20.7 GiB (weights 15.3 GiB," in result.stdout  # Qwen3-8B in bf16 beside its adapter
    assert "inference: 40.0 GiB claimed by vLLM" in result.stdout
    assert "GPU 0: trainer + inference = 60.7 GiB, free 19.3 GiB" in result.stdout

    result = rl_dry_run(tmp_path / "oversize", "--gpu-memory-gib", "80", "--inference.gpu-memory-utilization", "0.9")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "the run does not fit in memory: GPU 0: trainer 20.7 GiB + inference 72.0 GiB = 92.7 GiB does not fit " \
           "in its 80.0 GiB" in result.stderr  # fmt: skip
    assert not (tmp_path / "oversize").exists()  # refused before anything was written
