"""A memory plan for a run: what the trainer and the inference server need on each GPU, before anything starts.

The plan is arithmetic on the model's shape (its ``config.json``) and the configs: no weights are loaded. The
trainer's share is its weights (float32 master weights, or under LoRA the frozen base in the compute dtype and a
float32 adapter), gradients and AdamW's two moments of what trains (each split over the FSDP ranks), the working
copies FSDP gathers (the model's root and two decoder layers at a time), the activations kept for the backward
pass of one packed micro-batch of ``seq_len`` tokens under the configured activation checkpointing, the chunked
logits (``trainer.scoring``), and the CUDA context. The server's share is what vLLM claims up front:
``gpu_memory_utilization`` of the GPU, which must hold its weights and one ``max_model_len`` context of KV cache.
``benchmarks/memory_plan.py`` checks the trainer's figures against peaks measured on CPU.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from inference.config import InferenceConfig
from rl.errors import TridentError
from rl.model_path import resolve_model_path
from trainer.config import TrainerConfig
from trainer.scoring import CHUNK_ELEMENTS, chunk_rows

GIB = 2**30
CUDA_CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspaces and the caching allocator's slack, per process
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer (Qwen2/3 and Llama layouts)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def layer_parameters(self) -> int:
        return sum(n_in * n_out for n_in, n_out in self.linear_shapes().values()) + 2 * self.hidden_size

    @property
    def root_parameters(self) -> int:
        """Embeddings, the output layer unless tied, and the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def parameters(self) -> int:
        return self.root_parameters + self.num_hidden_layers * self.layer_parameters


# Shapes of common hub models, for planning where the hub cannot be reached (keyed by the id's last part).
KNOWN_SHAPES = {
    "Qwen3-0.6B": ModelShape(151_936, 1024, 3072, 28, 16, 8, 128, True),
    "Qwen3-1.7B": ModelShape(151_936, 2048, 6144, 28, 16, 8, 128, True),
    "Qwen3-4B": ModelShape(151_936, 2560, 9728, 36, 32, 8, 128, True),
    "Qwen3-8B": ModelShape(151_936, 4096, 12_288, 36, 32, 8, 128, False),
    "Qwen3-14B": ModelShape(151_936, 5120, 17_408, 40, 40, 8, 128, False),
    "Qwen2.5-7B-Instruct": ModelShape(152_064, 3584, 18_944, 28, 28, 4, 128, False),
    "Llama-3.1-8B-Instruct": ModelShape(128_256, 4096, 14_336, 32, 32, 8, 128, False),
}


def model_shape(name: str) -> ModelShape:
    """The shape of model ``name``: its local ``config.json``, a known hub model's, or the hub's config."""
    folder = Path(resolve_model_path(name)).expanduser()
    if (folder / "config.json").is_file():
        return ModelShape.from_config(json.loads((folder / "config.json").read_text()))
    if name.split("/")[-1] in KNOWN_SHAPES:
        return KNOWN_SHAPES[name.split("/")[-1]]
    try:
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(name).to_dict())
    except Exception as e:
        raise TridentError(f"model.name = {name!r}: cannot read its config.json to plan memory ({e})") from None


def dtype_bytes(dtype: str, gpu: bool) -> int:
    """Bytes per value of a configured compute dtype (``auto``: bfloat16 on GPU, float32 on CPU)."""
    return 4 if dtype == "float32" or (dtype == "auto" and not gpu) else 2


def lora_parameters(shape: ModelShape, targets: list[str], rank: int) -> int:
    """Parameters of a LoRA adapter of ``rank`` on the ``targets`` linear layers of every decoder layer."""
    linears = shape.linear_shapes()
    return shape.num_hidden_layers * sum(rank * sum(linears[t]) for t in targets if t in linears)


def activation_bytes_per_token(shape: ModelShape, compute: int) -> int:
    """Bytes one token keeps for the backward pass of one decoder layer (no checkpointing): the inputs of its
    norms (upcast to float32), matmuls, rotary embedding and attention, the attention output and the MLP's."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    norms = 2 * h * 4 + 2 * h * compute + (q + kv) * 4  # two RMSNorms' fp32 inputs and outputs; q/k norms (Qwen3)
    attention = compute * (3 * q + 3 * kv)  # q, k, v; rotated q, k; output (SDPA's saved tensors)
    mlp = compute * 4 * i  # gate and up outputs, the activation, their product
    return norms + attention + mlp


def trainer_plan(shape: ModelShape, trainer: TrainerConfig, ranks: int, gpu: bool) -> dict[str, float]:
    """GiB per trainer rank, by what holds them."""
    compute = dtype_bytes(trainer.model.dtype, gpu)
    lora = trainer.model.experimental.lora
    if lora is None:
        trainable, frozen_bytes = shape.parameters, 0
    else:
        trainable = lora_parameters(shape, lora.target_modules, lora.rank)
        frozen_bytes = shape.parameters * compute
    layers, tokens = shape.num_hidden_layers, trainer.seq_len
    per_layer = activation_bytes_per_token(shape, compute) * tokens
    checkpointed = 0 if trainer.model.ac is None else math.ceil(layers / trainer.model.ac.freq)
    # a checkpointed layer keeps its input; one layer at a time is recomputed in full, with its gradients
    activations = checkpointed * tokens * shape.hidden_size * compute + (layers - checkpointed) * per_layer
    activations += 2 * per_layer if checkpointed else per_layer
    logits = 3 * 4 * min(tokens, chunk_rows(shape.vocab_size)) * shape.vocab_size  # fp32 logits, softmax, gradient
    plan = {
        "weights": (frozen_bytes + trainable * 4) / ranks,
        "gradients": trainable * 4 / ranks,
        "optimizer": 2 * trainable * 4 / ranks,
        "gathered": (shape.root_parameters + 2 * shape.layer_parameters) * compute,
        "activations": activations,
        "logits": min(logits, 3 * 4 * CHUNK_ELEMENTS),
    }
    plan = {name: value / GIB for name, value in plan.items()}
    if gpu:
        plan["cuda"] = CUDA_CONTEXT_GIB
    plan["total"] = sum(plan.values())
    return plan


def inference_plan(shape: ModelShape, inference: InferenceConfig, gpu_gib: float | None) -> dict[str, float]:
    """GiB of an inference server: on each of its GPUs what vLLM claims up front (``gpu_memory_utilization`` of
    it), with what its share of the weights and of one full context's KV cache take of that (tensor parallelism
    splits both); on the CPU its weights and KV cache space."""
    weight_bytes = 4 if inference.model.dtype == "float32" or gpu_gib is None else 2
    shards = inference.tensor_parallel_size if gpu_gib is not None else 1
    weights = shape.parameters * weight_bytes / GIB / shards
    if gpu_gib is None:
        return {
            "weights": weights,
            "kv_cache": inference.kv_cache_space_gib,
            "total": weights + inference.kv_cache_space_gib,
        }
    kv_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * weight_bytes
    return {
        "weights": weights,
        "kv_one_context": inference.model.max_model_len * kv_per_token / GIB / shards,
        "total": inference.gpu_memory_utilization * gpu_gib,
    }


def size(gib: float) -> str:
    """``gib`` for a person: GiB from 1 GiB up, else MiB."""
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of a run: each process's GiB by part, and each GPU's total and what lands on it."""

    gpu_gib: float | None  # None: no GPUs, the trainer runs on the CPU
    trainer: dict[str, float]
    inference: dict[str, float] | None
    gpus: dict[int, list[str]]  # GPU id -> the processes placed on it

    def problems(self) -> list[str]:
        """Each way the plan does not fit, as a line naming the number at fault."""
        if self.gpu_gib is None:
            return []
        found = []
        if self.inference and self.inference["weights"] + self.inference["kv_one_context"] > self.inference["total"]:
            found.append(
                f"inference: vLLM's share ({size(self.inference['total'])}, inference.gpu_memory_utilization of "
                f"{size(self.gpu_gib)}) cannot hold its weights ({size(self.inference['weights'])}) and one "
                f"max_model_len context of KV cache ({size(self.inference['kv_one_context'])})"
            )
        for gpu, processes in self.gpus.items():
            need = sum(getattr(self, process)["total"] for process in processes)
            if need > self.gpu_gib:
                parts = " + ".join(f"{process} {size(getattr(self, process)['total'])}" for process in processes)
                found.append(
                    f"GPU {gpu}: {parts} = {size(need)} does not fit in its {size(self.gpu_gib)} "
                    f"(trainer: {self.describe('trainer')})"
                )
        return found

    def describe(self, process: str) -> str:
        parts = getattr(self, process)
        return ", ".join(f"{name} {size(value)}" for name, value in parts.items() if name != "total")

    def lines(self) -> list[str]:
        """The plan for a person to read."""
        lines = [f"memory plan ({'CPU' if self.gpu_gib is None else f'GPUs of {size(self.gpu_gib)}'}):"]
        lines.append(f"  trainer, per rank: {size(self.trainer['total'])} ({self.describe('trainer')})")
        if self.inference:
            claimed = "" if self.gpu_gib is None else " claimed by vLLM"
            lines.append(f"  inference: {size(self.inference['total'])}{claimed} ({self.describe('inference')})")
        for gpu, processes in self.gpus.items():
            used = sum(getattr(self, process)["total"] for process in processes)
            lines.append(f"  GPU {gpu}: {' + '.join(processes)} = {size(used)}, free {size(self.gpu_gib - used)}")
        return lines


def plan_memory(
    trainer: TrainerConfig,
    inference: InferenceConfig | None,
    trainer_gpus: list[int],
    inference_gpus: list[int],
    gpu_gib: float | None,
) -> MemoryPlan:
    """The memory plan of a run whose trainer ranks use ``trainer_gpus`` and whose server (when ``rl`` starts
    one) uses ``inference_gpus``, each GPU of ``gpu_gib`` GiB (None: no GPUs, everything on the CPU)."""
    shape = model_shape(trainer.model.name)
    gpu = gpu_gib is not None
    trainer_part = trainer_plan(shape, trainer, len(trainer_gpus) if gpu else 1, gpu)
    inference_part = inference_plan(shape, inference, gpu_gib) if inference is not None else None
    gpus: dict[int, list[str]] = {}
    if gpu:
        for gpu_id in trainer_gpus:
            gpus.setdefault(gpu_id, []).append("trainer")
        for gpu_id in inference_gpus if inference_part else []:
            gpus.setdefault(gpu_id, []).append("inference")
    return MemoryPlan(gpu_gib, trainer_part, inference_part, dict(sorted(gpus.items())))
