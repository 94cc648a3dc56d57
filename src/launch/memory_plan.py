"""A memory plan for a run: what the trainer and the inference server need on each GPU, before anything starts.

The plan is arithmetic on the model's shape (its ``config.json``, mixture-of-experts layers included) and the
configs: no weights are loaded. The trainer's share is its weights (float32 master weights, or under LoRA the frozen
base in the compute dtype, its linear layers in 4-bit NF4 under QLoRA, and a float32 adapter), gradients and AdamW's
two moments of what trains (each split over the FSDP ranks; a mixture of experts' routed experts under expert
parallelism over the ``ep`` ranks that hold them), the working copies FSDP gathers (the model's root and
two decoder layers at a time, or every layer where layers are not resharded after forward), the activations kept for
the backward pass of one packed micro-batch (``micro_batch_tokens``, else ``seq_len`` tokens) under the configured
activation checkpointing (a vision-language model's also its vision tower's, for image tokens filling the
micro-batch: kept through the backward pass where the tower trains, one block's at a time where it is frozen), the
backward pass's working memory at its peak (one chunk of logits, or one recomputed
layer or part with its gradients), under LoRA on routed experts the copies of their weights with the adapter folded
in, under expert parallelism the token dispatch's buffers, under QLoRA one linear layer dequantized, the weight
broadcast's send buffer, and on a GPU what the caching allocator reserves beyond that and the CUDA context. The
server's share is what vLLM claims up front: ``gpu_memory_utilization`` of the GPU, which must hold its weights and
one ``max_model_len`` context of KV cache, and beside it the weights it receives over the broadcast.
``benchmarks/memory_plan.py`` checks the trainer's figures against peaks measured on CPU; the unit tests hold them
to the device memory a trainer held on an H200 (``benchmarks/gpu_check.py``).
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from contracts.errors import TridentError
from contracts.model_path import resolve_model_path, routed_experts
from inference.config import InferenceConfig
from trainer.config import ParallelConfig, TrainerConfig, chunk_rows, reshards_after_forward

GIB = 2**30
# Fitted to a Qwen3-0.6B full fine-tune on an H200 (torch 2.11, 2026-11-26, benchmarks/results/gpu_check_history.json;
# the Qwen3-8B LoRA rows there are held out, tests/unit/launch/test_memory_plan.py): what the device holds for a trainer
# beyond the memory PyTorch reserves (CUDA context, cuBLAS workspaces) was 1.28-1.30 GiB; the caching allocator
# reserved 25-35 % of the activations' size beyond its peak allocation (freed activations of many sizes).
CUDA_CONTEXT_GIB = 1.25
ALLOCATOR_SLACK = 0.3  # of the activations
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# Bytes per logit at the peak of one chunk's backward (bf16 logits, their float32 copy and scaled copy, the
# softmax terms and the logits' gradient), measured on CPU with trainer.scoring.chunked_scores.
LOGIT_BYTES = 20
NF4_BLOCK, NF4_SCALE_BLOCK = 64, 256  # weights per 8-bit scale, and 8-bit scales per float32 scale (bitsandbytes)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer: Qwen2/3 and Llama layouts, and their mixture-of-experts
    variants (Qwen2-MoE, Qwen3-MoE), where ``sparse_layers`` of the layers have ``num_experts`` routed experts of
    ``moe_intermediate_size`` (``num_experts_per_tok`` of them per token), a router, and maybe a shared expert."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense layers' MLP
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    sparse_layers: int = 0
    vision: "VisionShape | None" = None  # a vision-language model's vision tower

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """The shape of a ``config.json``; a vision-language model's (Qwen3-VL's) language model from its
        ``text_config``, with its vision tower from its ``vision_config``."""
        if "vision_config" in config:
            text = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **config["text_config"]}
            return replace(cls.from_config(text), vision=VisionShape.from_config(config["vision_config"]))
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
            **experts_of(config),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a dense decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def attention_parameters(self) -> int:
        """A decoder layer's attention and its two norms (Qwen3's q/k norms, 2 × head_dim, left out)."""
        linears = self.linear_shapes()
        return sum(n_in * n_out for name, (n_in, n_out) in linears.items() if name not in MLP_LINEARS) + (
            2 * self.hidden_size
        )

    @property
    def sparse_mlp_parameters(self) -> int:
        """A mixture-of-experts MLP: every routed expert, the router (hidden × experts), the shared expert and its
        gate (hidden × 1)."""
        h, shared = self.hidden_size, self.shared_expert_intermediate_size
        experts = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        return experts + (3 * h * shared + h if shared else 0)

    @property
    def layer_experts(self) -> int:
        """A sparse layer's routed experts (gate, up and down of each): what expert parallelism splits."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_parameters(self) -> int:
        """The routed experts of every sparse layer."""
        return self.sparse_layers * self.layer_experts

    @property
    def layer_parameters(self) -> int:
        """The largest decoder layer's parameters."""
        return self.gathered_layer_parameters(ep=1)

    def gathered_layer_parameters(self, ep: int) -> int:
        """The largest decoder layer's parameters FSDP gathers: all of them, or under expert parallelism (``ep`` > 1)
        all but the routed experts, which each rank holds its share of itself."""
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = self.sparse_mlp_parameters - (self.layer_experts if ep > 1 else 0)
        return self.attention_parameters + max(dense if self.sparse_layers < self.num_hidden_layers else 0,
                                               sparse if self.sparse_layers else 0)  # fmt: skip

    @property
    def root_parameters(self) -> int:
        """Embeddings, the output layer unless tied, the final norm, and a vision tower (what FSDP holds in the
        model's root, outside the decoder layers)."""
        vision = self.vision.parameters if self.vision else 0
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size + vision

    @property
    def vision_parameters(self) -> int:
        """The vision tower's parameters (0: a text model)."""
        return self.vision.parameters if self.vision else 0

    @property
    def parameters(self) -> int:
        """All parameters, every expert counted."""
        dense_layers = self.num_hidden_layers - self.sparse_layers
        mlps = dense_layers * 3 * self.hidden_size * self.intermediate_size
        mlps += self.sparse_layers * self.sparse_mlp_parameters
        return self.root_parameters + self.num_hidden_layers * self.attention_parameters + mlps

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest weight tensor: the embeddings, a dense MLP's matrix, or a MoE layer's fused
        gate-and-up experts (experts × 2 · moe_intermediate_size × hidden, transformers' layout)."""
        h = self.hidden_size
        return max(self.vocab_size * h, h * self.intermediate_size if self.sparse_layers < self.num_hidden_layers
                   else 0, self.num_experts * 2 * self.moe_intermediate_size * h)  # fmt: skip


@dataclass(frozen=True)
class VisionShape:
    """A Qwen3-VL vision tower (transformers' ``Qwen3VLVisionModel``, from a ``vision_config``): a patch embedding
    of ``in_channels × temporal_patch_size × patch_size²`` features, learned position embeddings, ``depth`` blocks
    (layer norms, attention on a fused qkv, an MLP of ``intermediate_size``), and a patch merger plus one DeepStack
    merger per ``deepstack_visual_indexes`` entry, each taking ``spatial_merge_size²`` patches to one image token of
    ``out_hidden_size``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_features: int
    num_position_embeddings: int
    spatial_merge_size: int
    out_hidden_size: int
    deepstack_mergers: int

    @classmethod
    def from_config(cls, config: dict) -> "VisionShape":
        return cls(
            depth=config["depth"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=config["num_heads"],
            patch_features=config.get("in_channels", 3) * config["temporal_patch_size"] * config["patch_size"] ** 2,
            num_position_embeddings=config["num_position_embeddings"],
            spatial_merge_size=config["spatial_merge_size"],
            out_hidden_size=config["out_hidden_size"],
            deepstack_mergers=len(config.get("deepstack_visual_indexes") or []),
        )

    @property
    def merged_features(self) -> int:
        """Features of the ``spatial_merge_size²`` patches a merger takes as one image token."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def parameters(self) -> int:
        h, i, merged = self.hidden_size, self.intermediate_size, self.merged_features
        embedding = (self.patch_features + 1) * h + self.num_position_embeddings * h
        block = 4 * h + (h + 1) * 3 * h + (h + 1) * h + (h + 1) * i + (i + 1) * h  # 2 norms, qkv, proj, MLP
        merger = (merged + 1) * merged + (merged + 1) * self.out_hidden_size  # two linears, and a norm:
        norms = 2 * h + self.deepstack_mergers * 2 * merged  # before the merge, or (DeepStack) after it
        return embedding + self.depth * block + (1 + self.deepstack_mergers) * merger + norms

    def block_activation_bytes(self, compute: int) -> int:
        """Bytes one patch keeps for the backward pass of one vision block (read with ``saved_tensors_hooks`` in
        bf16): the inputs of its norms and linear layers, q, k and v (and q and k in float32 for the rotary
        embedding), the attention's output, the MLP's activation input, the norms' statistics and the
        attention's log-sum-exp."""
        h, i = self.hidden_size, self.intermediate_size
        return compute * (8 * h + 2 * i) + 4 * 2 * h + 16 + 4 * self.num_heads

    def activation_bytes(self, tokens: int, compute: int, trained: bool) -> int:
        """Bytes of the tower's activations for ``tokens`` image tokens (``spatial_merge_size²`` patches each): kept
        through the backward pass where it trains (every block's, the mergers' inputs and the patches), else one
        block's at a time in its forward pass; and the image tokens' embeddings (the merger's and the DeepStack
        mergers'), which the language model's forward pass reads."""
        patches = tokens * self.spatial_merge_size**2
        embeddings = tokens * (1 + self.deepstack_mergers) * self.out_hidden_size * compute
        if not trained:
            return patches * self.block_activation_bytes(compute) + embeddings
        mergers = (1 + self.deepstack_mergers) * 4 * self.hidden_size * compute
        kept = self.depth * self.block_activation_bytes(compute) + mergers + self.patch_features * compute
        return patches * kept + embeddings


def experts_of(config: dict) -> dict[str, int]:
    """The mixture-of-experts fields of a ``config.json`` (none for a dense model; the experts counted by
    :func:`contracts.model_path.routed_experts`): experts ``moe_intermediate_size`` wide (Mixtral's and gpt-oss's:
    ``intermediate_size``), a shared expert of Qwen-MoE's ``shared_expert_intermediate_size`` or DeepSeek's
    ``n_shared_experts`` of expert width."""
    experts = routed_experts(config)
    if not experts:
        return {}
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    shared = config.get("shared_expert_intermediate_size") or (config.get("n_shared_experts") or 0) * size
    return {
        "num_experts": experts,
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": size,
        "shared_expert_intermediate_size": shared,
        "sparse_layers": len(sparse_layer_ids(config)),
    }


def sparse_layer_ids(config: dict) -> list[int]:
    """The decoder layers of a mixture-of-experts ``config`` whose MLP is sparse: Qwen-MoE's every
    ``decoder_sparse_step``-th layer but its ``mlp_only_layers``, after DeepSeek's ``first_k_dense_replace``."""
    step, dense = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or [])
    first = config.get("first_k_dense_replace") or 0
    layers = range(config["num_hidden_layers"])
    return [i for i in layers if i >= first and i not in dense and (i + 1) % step == 0]


# Shapes of common hub models, for planning where the hub cannot be reached (keyed by the id's last part).
KNOWN_SHAPES = {
    "Qwen3-0.6B": ModelShape(151_936, 1024, 3072, 28, 16, 8, 128, True),
    "Qwen3-1.7B": ModelShape(151_936, 2048, 6144, 28, 16, 8, 128, True),
    "Qwen3-4B": ModelShape(151_936, 2560, 9728, 36, 32, 8, 128, True),
    "Qwen3-8B": ModelShape(151_936, 4096, 12_288, 36, 32, 8, 128, False),
    "Qwen3-14B": ModelShape(151_936, 5120, 17_408, 40, 40, 8, 128, False),
    "Qwen3-30B-A3B": ModelShape(
        151_936,
        2048,
        6144,
        48,
        32,
        4,
        128,
        False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        sparse_layers=48,
    ),  # fmt: skip
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


def nf4_bytes(parameters: int) -> int:
    """Bytes of one weight matrix in 4-bit NF4 with double quantization (bitsandbytes): two codes a byte, an 8-bit
    scale per block of 64 weights, a float32 scale per 256 of those, the scales' float32 offset and the two code
    tables (16 and 256 float32)."""
    blocks = math.ceil(parameters / NF4_BLOCK)
    return math.ceil(parameters / 2) + blocks + 4 * math.ceil(blocks / NF4_SCALE_BLOCK) + 4 * (1 + 16 + 256)


def quantized_linears(shape: ModelShape, sparse: bool) -> list[int]:
    """Weights of each linear layer of a decoder layer that a 4-bit base holds in NF4: bitsandbytes quantizes the
    ``nn.Linear`` layers, those of the attention and of a dense MLP or a shared expert; routed experts (fused
    tensors) stay in the compute dtype."""
    linears = shape.linear_shapes()
    attention = [n_in * n_out for name, (n_in, n_out) in linears.items() if name not in MLP_LINEARS]
    if not sparse:
        return attention + [n_in * n_out for name, (n_in, n_out) in linears.items() if name in MLP_LINEARS]
    return attention + [shape.hidden_size * shape.shared_expert_intermediate_size] * (
        3 if shape.shared_expert_intermediate_size else 0
    )


def layer_bytes_4bit(shape: ModelShape, compute: int, sparse: bool) -> int:
    """Bytes of a decoder layer of a 4-bit base: its quantized linears in NF4, the rest in the compute dtype."""
    quantized = quantized_linears(shape, sparse)
    mlp = shape.sparse_mlp_parameters if sparse else 3 * shape.hidden_size * shape.intermediate_size
    return sum(map(nf4_bytes, quantized)) + (shape.attention_parameters + mlp - sum(quantized)) * compute


def base_bytes_4bit(shape: ModelShape, compute: int) -> int:
    """Bytes of a frozen base whose linear layers are 4-bit NF4 (QLoRA), about 0.516 a quantized weight; the
    embeddings, the output layer and the norms stay in the compute dtype."""
    layers = sum(count * layer_bytes_4bit(shape, compute, sparse) for sparse, count in layer_kinds(shape).items())
    return layers + shape.root_parameters * compute


def lora_parameters(shape: ModelShape, targets: list[str], rank: int) -> int:
    """Parameters of a LoRA adapter of ``rank`` on the ``targets`` linear layers of every decoder layer.

    In a mixture-of-experts layer the MLP targets adapt the shared expert's linears and, as peft converts them
    for transformers' fused experts (Qwen3-MoE), each routed expert: gate and up together at twice the rank
    (``2·rank × (hidden + 2·moe_intermediate_size)`` each), down at the rank. For MoE models whose experts peft
    leaves alone (Qwen2-MoE) this is an upper bound.
    """
    linears, h = shape.linear_shapes(), shape.hidden_size
    attention = sum(rank * sum(linears[t]) for t in targets if t in linears and t not in MLP_LINEARS)
    dense = sum(rank * sum(linears[t]) for t in targets if t in MLP_LINEARS)
    shared = sum(rank * (h + shape.shared_expert_intermediate_size) for t in targets
                 if t in MLP_LINEARS and shape.shared_expert_intermediate_size)  # fmt: skip
    dense_layers = shape.num_hidden_layers - shape.sparse_layers
    return (
        shape.num_hidden_layers * attention
        + dense_layers * dense
        + shape.sparse_layers * (shared + expert_lora_parameters(shape, targets, rank))
    )


def adapted_experts(shape: ModelShape, targets: list[str]) -> dict[str, tuple[int, int]]:
    """The fused routed-expert weights a LoRA on ``targets`` adapts, with their (in, out) features per expert:
    ``gate_up_proj`` when gate and up are both targets, ``down_proj`` when down is."""
    h, size = shape.hidden_size, shape.moe_intermediate_size
    fused = {"gate_up_proj": (h, 2 * size)} if {"gate_proj", "up_proj"} <= set(targets) else {}
    return fused | ({"down_proj": (size, h)} if "down_proj" in targets and shape.num_experts else {})


def expert_lora_parameters(shape: ModelShape, targets: list[str], rank: int) -> int:
    """Parameters of a LoRA adapter on one sparse layer's routed experts, as peft builds it for fused experts: gate
    and up together at twice the rank, down at the rank, per expert."""
    ranks = {"gate_up_proj": 2 * rank, "down_proj": rank}
    fused = adapted_experts(shape, targets)
    return sum(shape.num_experts * ranks[name] * (n_in + n_out) for name, (n_in, n_out) in fused.items())


def mlp_width(shape: ModelShape, sparse: bool) -> int:
    """Intermediate features one token goes through in a layer's MLP: its routed experts' and the shared
    expert's in a sparse layer."""
    if not sparse:
        return shape.intermediate_size
    return shape.num_experts_per_tok * shape.moe_intermediate_size + shape.shared_expert_intermediate_size


def layer_activation_parts(shape: ModelShape, compute: int, full: bool, sparse: bool) -> dict[str, int]:
    """Bytes one token keeps for the backward pass of one decoder layer (no checkpointing), as autograd saves
    them (read with ``saved_tensors_hooks`` on Qwen3 and Qwen3-MoE layers in bf16), by part: ``norms``, the float32
    inputs of the two layer norms (and, when the norms train, their outputs) with their reciprocal RMS;
    ``attention``, the inputs of its linear layers (q/k/v and o), Qwen3's q and k norms as the layer norms, the
    rotated q and k, v, cos and sin, and the attention's log-sum-exp (its output is o's input); ``mlp``, its
    input and its gate, up, activation and product (a sparse layer keeps these per routed expert with the expert's
    copies of its input and output, and the router's float32 probabilities)."""
    h, c = shape.hidden_size, compute
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    per_norm_value = 4 + (c if full else 0)
    norms = 2 * h * per_norm_value + 4 * 2
    qk_norms = (q + kv) * per_norm_value + 4 * (shape.num_attention_heads + shape.num_key_value_heads)
    attention = c * (h + 2 * q + 2 * kv + 2 * shape.head_dim) + 4 * shape.num_attention_heads + qk_norms
    mlp = c * (h + 4 * mlp_width(shape, sparse))
    if sparse:
        mlp += shape.num_experts_per_tok * 2 * h * c + 4 * shape.num_experts
    return {"norms": norms, "attention": attention, "mlp": mlp}


def layer_activation_bytes(shape: ModelShape, compute: int, full: bool, sparse: bool) -> int:
    """Bytes one token keeps for the backward pass of one decoder layer (no checkpointing): all its parts."""
    return sum(layer_activation_parts(shape, compute, full, sparse).values())


def checkpointed_layer_bytes(shape: ModelShape, compute: int, full: bool, sparse: bool, part: str) -> int:
    """Bytes one token keeps for the backward pass of a decoder layer whose ``part`` is recomputed there: the
    recomputed part keeps only its inputs (the normed hidden state; the attention also cos and sin)."""
    inputs = {"layer": shape.hidden_size, "mlp": shape.hidden_size, "attention": shape.hidden_size + 2 * shape.head_dim}
    if part == "layer":
        return inputs["layer"] * compute
    parts = layer_activation_parts(shape, compute, full, sparse)
    return sum(parts.values()) - parts[part] + inputs[part] * compute


def layer_gradient_bytes(shape: ModelShape, compute: int, full: bool, sparse: bool) -> int:
    """Bytes per token of the gradients alive at the peak of one decoder layer's backward pass: the MLP's gate and
    up outputs' and the layer input's (and, when the norms train, the residual stream's), measured on CPU."""
    return compute * (2 * mlp_width(shape, sparse) + (2 if full else 1) * shape.hidden_size)


def layer_kinds(shape: ModelShape) -> dict[bool, int]:
    """How many decoder layers are dense (False) and sparse (True)."""
    kinds = {False: shape.num_hidden_layers - shape.sparse_layers, True: shape.sparse_layers}
    return {sparse: count for sparse, count in kinds.items() if count}


def rank_tokens(trainer: TrainerConfig) -> int:
    """Tokens of a micro-batch each trainer rank runs: all of ``micro_batch_tokens`` (else ``seq_len``), or under
    context parallelism its ``1 / cp`` shard."""
    return -(-trainer.micro_batch_budget // trainer.model.parallel.cp)


def offloaded_bytes(shape: ModelShape, trainer: TrainerConfig, compute: int) -> int:
    """Bytes of the checkpointed layers' inputs a rank keeps in host memory under ``model.ac.offload`` (0 without):
    each checkpointed layer's input, for the rank's tokens."""
    ac = trainer.model.ac
    if ac is None or not ac.offload:
        return 0
    return math.ceil(shape.num_hidden_layers / ac.freq) * shape.hidden_size * compute * rank_tokens(trainer)


def activation_bytes(shape: ModelShape, trainer: TrainerConfig, compute: int) -> tuple[float, float]:
    """Bytes of the activations of the micro-batch tokens a rank runs (:func:`rank_tokens`): those kept through the
    backward pass (a checkpointed layer keeps what :func:`checkpointed_layer_bytes` says, nothing under
    ``model.ac.offload``, any other layer all it saves), and the working memory at the backward pass's peak, the
    larger of one chunk of logits and one layer's recomputed activations (checkpointing; offloaded, with its input
    brought back) with its gradients."""
    full, tokens, layers = trainer.model.experimental.lora is None, rank_tokens(trainer), shape.num_hidden_layers
    ac, kinds = trainer.model.ac, layer_kinds(shape)
    part = ac.part if ac is not None else "layer"
    checkpointed = 0 if ac is None else math.ceil(layers / ac.freq)
    offload = ac is not None and ac.offload
    saved = sum(count * layer_activation_bytes(shape, compute, full, sparse) for sparse, count in kinds.items())
    saved_checkpointed = 0 if offload else sum(
        count * checkpointed_layer_bytes(shape, compute, full, sparse, part) for sparse, count in kinds.items()
    )  # fmt: skip
    kept = (checkpointed * saved_checkpointed + (layers - checkpointed) * saved) / layers

    def recomputed_bytes(sparse: bool) -> int:
        parts = layer_activation_parts(shape, compute, full, sparse)
        return sum(parts.values()) if part == "layer" else parts[part]

    brought_back = shape.hidden_size * compute if offload else 0  # the recomputed layer's input, from the host
    recomputed = max(
        (recomputed_bytes(sparse) + brought_back if checkpointed else 0)
        + layer_gradient_bytes(shape, compute, full, sparse)
        for sparse in kinds
    )
    logits = LOGIT_BYTES * min(tokens, chunk_rows(shape.vocab_size)) * shape.vocab_size
    return kept * tokens, max(recomputed * tokens, logits)


def broadcast_backend(trainer: TrainerConfig, gpu: bool) -> str | None:
    """The weight broadcast's backend (``trainer.weight_broadcast``, None when it is off): ``auto`` is what ``rl``
    settled it to (``shared`` or ``nccl``) or, for a server ``rl`` does not start, the trainer's own pick."""
    broadcast = trainer.weight_broadcast
    if broadcast is None:
        return None
    return ("nccl" if gpu else "gloo") if broadcast.backend == "auto" else broadcast.backend


def trainer_broadcast_bytes(shape: ModelShape, backend: str, compute: int, gpu: bool) -> int:
    """Bytes the trainer's rank 0 holds for the weight broadcast, on its GPU (or the CPU): a shared buffer of the
    full weights in the compute dtype; over NCCL one tensor at a time moved to the GPU (the largest) while the next
    step runs; over gloo the full weights in host memory until the server took them."""
    if backend == "shared":
        return shape.parameters * compute
    if backend == "nccl":
        return shape.largest_tensor * compute
    return 0 if gpu else shape.parameters * compute


def gathered_bytes(
    shape: ModelShape, trainer: TrainerConfig, ranks: int, compute: int, gpu: bool, layer_bytes: int
) -> int:
    """Bytes of the working copies FSDP gathers: the root in the compute dtype and two decoder layers of
    ``layer_bytes`` at a time, or every layer from its forward pass to its backward pass where layers are not
    resharded after forward. Under expert parallelism ``layer_bytes`` leaves the routed experts out, and FSDP
    gathers each rank's own ``num_experts / ep`` experts of those two layers over its replicas instead."""
    if not reshards_after_forward(trainer.model, ranks, gpu, trainer.optim.offload and gpu):
        return shape.parameters * compute
    ep = trainer.model.parallel.ep
    local_experts = shape.layer_experts // ep * compute if ep > 1 else 0
    return shape.root_parameters * compute + 2 * (layer_bytes + local_experts)


def routed_expert_bytes(shape: ModelShape, trainer: TrainerConfig, compute: int) -> dict[str, float]:
    """Bytes the routed experts of a mixture of experts add beyond what a dense layer holds (none in a dense model):

    - ``lora_experts``: a LoRA on the routed experts is folded into their fused weights (peft's parametrization:
      ``W + scale · B·A``) at each forward, and autograd keeps that folded copy of the layer's experts (this rank's
      ``num_experts / ep``) for the backward pass: one per sparse layer that is not checkpointed, one for the layer
      recomputed in the backward pass, and one its gradient (the kept copy as ``saved_tensors_hooks`` read it);
    - ``all_to_all``: under expert parallelism a layer's dispatch sends each token's ``num_experts_per_tok``
      copies to the ranks of its experts and receives as many (the send and receive buffers, in the compute dtype,
      for routing balanced over the ranks; the combine's way back reuses the same sizes).
    """
    ep, lora, ac = trainer.model.parallel.ep, trainer.model.experimental.lora, trainer.model.ac
    parts = {}
    fused = adapted_experts(shape, lora.target_modules) if lora is not None and shape.sparse_layers else {}
    if fused:
        copy = shape.num_experts // ep * sum(n_in * n_out for n_in, n_out in fused.values()) * compute
        kept = shape.sparse_layers if ac is None else shape.sparse_layers - math.ceil(shape.sparse_layers / ac.freq)
        parts["lora_experts"] = (kept + (ac is not None) + 1) * copy
    if ep > 1:
        routed = trainer.micro_batch_budget * shape.num_experts_per_tok
        parts["all_to_all"] = 2 * routed * shape.hidden_size * compute
    return parts


def context_parallel_bytes(shape: ModelShape, trainer: TrainerConfig, compute: int) -> dict[str, float]:
    """Under context parallelism, ``all_to_all``: the buffers around one layer's attention, where a rank's tokens
    are traded for the whole row's: its q, k and v (key and value heads repeated up to ``lcm(kv_heads, cp)``) and
    the attention's output, each sent and received, in the compute dtype (none without)."""
    cp = trainer.model.parallel.cp
    if cp == 1:
        return {}
    kv_heads = math.lcm(shape.num_key_value_heads, cp)
    per_token = 2 * (shape.num_attention_heads + kv_heads) * shape.head_dim * compute
    return {"all_to_all": 2 * per_token * rank_tokens(trainer)}


def trainer_plan(shape: ModelShape, trainer: TrainerConfig, ranks: int, gpu: bool) -> dict[str, float]:
    """GiB per trainer rank, by what holds them: what trains and the frozen base split over the ranks (under expert
    parallelism too: a rank's ``num_experts / ep`` experts are split further over the ``ranks / ep`` replicas).
    A vision-language model's vision tower counts among what trains only where ``model.vision_tower`` trains it
    (frozen in full training, it keeps its float32 weights but no gradients or optimizer state; the adapters LoRA
    puts on it are left out, as small), and its activations are the ``vision`` part."""
    compute = dtype_bytes(trainer.model.dtype, gpu)
    lora, in_4bit = trainer.model.experimental.lora, trainer.model.experimental.load_in_4bit
    vision_trained = trainer.model.vision_tower == "trained"
    layer_bytes = shape.gathered_layer_parameters(trainer.model.parallel.ep) * compute
    if lora is None:
        frozen = 0 if vision_trained else shape.vision_parameters
        trainable, frozen_bytes = shape.parameters - frozen, frozen * 4
    else:
        trainable, frozen_bytes = lora_parameters(shape, lora.target_modules, lora.rank), shape.parameters * compute
    if in_4bit:
        frozen_bytes = base_bytes_4bit(shape, compute)
        layer_bytes = max(layer_bytes_4bit(shape, compute, sparse) for sparse in layer_kinds(shape))
    trained = trainable / ranks * 4  # float32 bytes of what trains, on this rank
    activations, backward = activation_bytes(shape, trainer, compute)
    plan = {
        "weights": frozen_bytes / ranks + trained,
        "gradients": trained,
        "optimizer": 2 * trained,
        "gathered": gathered_bytes(shape, trainer, ranks, compute, gpu, layer_bytes),
        "activations": activations,
        "backward": backward,
        **routed_expert_bytes(shape, trainer, compute),
        **context_parallel_bytes(shape, trainer, compute),
    }
    if shape.vision:
        plan["vision"] = shape.vision.activation_bytes(trainer.micro_batch_budget, compute, vision_trained)
    if in_4bit:  # each 4-bit linear is dequantized to the compute dtype to multiply, one at a time
        plan["dequantized"] = max(max(quantized_linears(shape, sparse)) for sparse in layer_kinds(shape)) * compute
    backend = broadcast_backend(trainer, gpu)
    held = trainer_broadcast_bytes(shape, backend, compute, gpu) if backend else 0
    if held:
        plan["broadcast"] = held
    plan = {name: value / GIB for name, value in plan.items()}
    if gpu:
        plan["allocator"] = ALLOCATOR_SLACK * plan["activations"]
        plan["cuda"] = CUDA_CONTEXT_GIB
    plan["total"] = sum(plan.values())
    if host := offloaded_bytes(shape, trainer, compute):  # in host memory, not the GPU's
        plan["host"] = host / GIB
    return plan


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
    experts: int = 0  # routed experts of each sparse layer; 0: a dense model
    ep: int = 1  # expert parallelism: ranks each sparse layer's experts are split over
    runs: int = 1  # trainers on the trainer GPUs (a sweep's runs), each as ``trainer`` plans
    cp: int = 1  # context parallelism: ranks each micro-batch's tokens are split over
    tokens: int = 0  # of a micro-batch (micro_batch_tokens, else seq_len)
    cp_advice: str = ""  # where the trainer does not fit: the context parallelism that would make it fit

    def total(self, process: str) -> float:
        """GiB of ``process`` on each of its GPUs: the trainer's counted once per run."""
        return getattr(self, process)["total"] * (self.runs if process == "trainer" else 1)

    def problems(self) -> list[str]:
        """Each way the plan does not fit, as a line naming the number at fault."""
        if self.gpu_gib is None:
            return []
        found = []
        inference = self.inference
        held = ("weights", "kv_one_context", "adapters")
        if inference and sum(inference.get(part, 0) for part in held) > inference["claimed"]:
            slots = f", its LoRA slots ({size(inference['adapters'])})" if "adapters" in inference else ""
            found.append(
                f"inference: vLLM's share ({size(inference['claimed'])}, inference.gpu_memory_utilization of "
                f"{size(self.gpu_gib)}) cannot hold its weights ({size(inference['weights'])}){slots} and one "
                f"max_model_len context of KV cache ({size(inference['kv_one_context'])})"
            )
        for gpu, processes in self.gpus.items():
            need = sum(self.total(process) for process in processes)
            if need > self.gpu_gib:
                parts = " + ".join(f"{self.process_label(p)} {size(self.total(p))}" for p in processes)
                found.append(
                    f"GPU {gpu}: {parts} = {size(need)} does not fit in its {size(self.gpu_gib)} "
                    f"(trainer: {self.describe('trainer')})"
                )
        if found and self.cp_advice:
            found.append(self.cp_advice)
        return found

    def process_label(self, process: str) -> str:
        return f"{self.runs} trainers" if process == "trainer" and self.runs > 1 else process

    def describe(self, process: str) -> str:
        parts = getattr(self, process)
        skipped = ("total", "claimed", "host")
        return ", ".join(f"{name} {size(value)}" for name, value in parts.items() if name not in skipped)

    def lines(self) -> list[str]:
        """The plan for a person to read."""
        lines = [f"memory plan ({'CPU' if self.gpu_gib is None else f'GPUs of {size(self.gpu_gib)}'}):"]
        split = f" (ep {self.ep}: {self.experts // self.ep} of {self.experts} experts a rank)" if self.experts else ""
        if self.cp > 1:
            split = f" (cp {self.cp}: {-(-self.tokens // self.cp):,} of {self.tokens:,} tokens a rank)"
        lines.append(f"  trainer, per rank{split}: {size(self.trainer['total'])} ({self.describe('trainer')})")
        if "host" in self.trainer:
            lines.append(f"  trainer, per rank in host memory (model.ac.offload): {size(self.trainer['host'])}")
        if self.runs > 1:
            lines.append(
                f"  {self.runs} trainers (one per run, each its own base, adapter and optimizer state): "
                f"{size(self.total('trainer'))} per rank"
            )
        if self.inference:
            parts, total = self.describe("inference"), size(self.inference["total"])
            if self.gpu_gib is None:
                lines.append(f"  inference: {total} ({parts})")
            else:
                in_all = f", {total} in all" if "broadcast" in self.inference else ""
                lines.append(f"  inference: {size(self.inference['claimed'])} claimed by vLLM ({parts}){in_all}")
        for gpu, processes in self.gpus.items():
            used = sum(self.total(process) for process in processes)
            names = " + ".join(map(self.process_label, processes))
            lines.append(f"  GPU {gpu}: {names} = {size(used)}, free {size(self.gpu_gib - used)}")
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
    ranks, ep = len(trainer_gpus) if gpu else 1, trainer.model.parallel.ep
    trainer_part = trainer_plan(shape, trainer, ranks, gpu)
    broadcast = broadcast_backend(trainer, gpu)
    inference_part = inference_plan(shape, inference, gpu_gib, broadcast) if inference is not None else None
    gpus: dict[int, list[str]] = {}
    if gpu:
        for gpu_id in trainer_gpus:
            gpus.setdefault(gpu_id, []).append("trainer")
        for gpu_id in inference_gpus if inference_part else []:
            gpus.setdefault(gpu_id, []).append("inference")
    plan = MemoryPlan(gpu_gib, trainer_part, inference_part, dict(sorted(gpus.items())), shape.num_experts, ep,
                      cp=trainer.model.parallel.cp, tokens=trainer.micro_batch_budget)  # fmt: skip
    if plan.problems():
        plan = replace(plan, cp_advice=context_parallel_advice(shape, trainer, plan, ranks))
    return plan


def context_parallel_advice(shape: ModelShape, trainer: TrainerConfig, plan: MemoryPlan, ranks: int) -> str:
    """For a plan whose trainer does not fit: the smallest context parallelism above ``model.parallel.cp`` that
    would make it fit (a degree dividing the trainer's ``ranks`` and the model's attention heads); nothing where
    none does, or where the model cannot be split so (a mixture of experts, a vision-language model, QLoRA)."""
    model = trainer.model
    if shape.num_experts or shape.vision or model.experimental.load_in_4bit or model.parallel.ep > 1:
        return ""
    for cp in range(model.parallel.cp + 1, ranks + 1):
        if ranks % cp or shape.num_attention_heads % cp:
            continue
        split = trainer.model_copy(update={"model": model.model_copy(update={"parallel": ParallelConfig(cp=cp)})})
        part = trainer_plan(shape, split, ranks, gpu=True)
        if not replace(plan, trainer=part, cp_advice="").problems():
            return f"trainer.model.parallel.cp = {cp} fits ({size(part['total'])} per rank)"
    return ""
