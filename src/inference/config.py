"""The inference server's config (``uv run inference @ infer.toml``)."""

from typing import Annotated, Literal

from pydantic import Field

from rl.config import BaseConfig
from rl.shared_config import LogConfig, ModelConfig, Seed


class InferenceModelConfig(ModelConfig):
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Field(description="Weights dtype in vLLM. 'auto' is float32 on CPU and the checkpoint's dtype on GPU."),
    ] = "auto"
    max_model_len: Annotated[int, Field(ge=16, description="Longest prompt + completion the server accepts.")] = 2048
    enforce_eager: Annotated[bool, Field(description="Skip CUDA graph capture (faster start, slower decode).")] = False
    enable_auto_tool_choice: Annotated[bool, Field(description="Let the model decide when to call tools.")] = True
    tool_call_parser: Annotated[str, Field(description="vLLM tool-call parser matching the chat template.")] = "hermes"


class InferenceConfig(BaseConfig):
    model: InferenceModelConfig = InferenceModelConfig()
    host: Annotated[str, Field(description="Address to listen on. Keep 127.0.0.1 unless you need remote access.")] = (
        "127.0.0.1"
    )
    port: Annotated[int, Field(ge=1, le=65535, description="Port to listen on.")] = 8000
    gpu_memory_utilization: Annotated[
        float, Field(gt=0, le=1, description="Share of GPU memory vLLM may take (weights + KV cache).")
    ] = 0.9
    kv_cache_space_gib: Annotated[
        int, Field(ge=1, description="KV cache size on CPU in GiB (VLLM_CPU_KVCACHE_SPACE).")
    ] = 1
    seed: Seed = 0
    log: LogConfig = LogConfig()
