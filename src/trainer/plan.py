"""The trainer's memory figure: what one trainer rank needs, before anything loads (torch-free; ``rl``'s memory plan
sums it with the server's, :mod:`launch.memory_plan`).

The figure is arithmetic on the model card's shape (mixture-of-experts layers included) and the trainer's config: no
weights are loaded. A rank holds its weights (float32 master weights, or under LoRA the frozen base in the compute
dtype, its linear layers in 4-bit NF4 under QLoRA, and a float32 adapter), gradients and AdamW's two moments of what
trains (each split over the FSDP ranks; a mixture of experts' routed experts under expert parallelism over the ``ep``
ranks that hold them), the working copies FSDP gathers (the model's root and two decoder layers at a time, or every
layer where layers are not resharded after forward), the activations kept for the backward pass of one packed
micro-batch (``micro_batch_tokens``, else ``seq_len`` tokens) under the configured activation checkpointing (a
vision-language model's also its vision tower's, for image tokens filling the micro-batch: kept through the backward
pass where the tower trains, one block's at a time where it is frozen), the backward pass's working memory at its
peak (one chunk of logits, or one recomputed layer or part with its gradients), under LoRA on routed experts the
copies of their weights with the adapter folded in, under expert parallelism the token dispatch's buffers, under
QLoRA one linear layer dequantized, the weight broadcast's send buffer, and on a GPU what the caching allocator
reserves beyond that and the CUDA context. ``benchmarks/memory_plan.py`` checks these figures against peaks measured
on CPU; the unit tests hold them to the device memory a trainer held on an H200 (``benchmarks/gpu_check.py``).
"""

import math

from contracts.model_card import (
    GIB,
    MLP_LINEARS,
    ModelShape,
    VisionShape,
    adapted_experts,
    lora_parameters,
)
from trainer.config import TrainerConfig, TrainerModelConfig

# Fitted to a Qwen3-0.6B full fine-tune on an H200 (torch 2.11, 2026-11-26, benchmarks/results/gpu_check_history.json;
# the Qwen3-8B LoRA rows there are held out, tests/unit/launch/test_memory_plan.py): what the device holds for a trainer
# beyond the memory PyTorch reserves (CUDA context, cuBLAS workspaces) was 1.28-1.30 GiB; the caching allocator
# reserved 25-35 % of the activations' size beyond its peak allocation (freed activations of many sizes).
CUDA_CONTEXT_GIB = 1.25
ALLOCATOR_SLACK = 0.3  # of the activations
# Bytes per logit at the peak of one chunk's backward (bf16 logits, their float32 copy and scaled copy, the
# softmax terms and the logits' gradient), measured on CPU with trainer.scoring.chunked_scores.
LOGIT_BYTES = 20
NF4_BLOCK, NF4_SCALE_BLOCK = 64, 256  # weights per 8-bit scale, and 8-bit scales per float32 scale (bitsandbytes)


# Elements of one chunk's logits (trainer.scoring): 2**25 fp32 values are 128 MiB (220 positions at a 152k
# vocabulary).
CHUNK_ELEMENTS = 2**25


def chunk_rows(vocab_size: int) -> int:
    """Positions per scoring chunk: as many as keep one chunk's logits within :data:`CHUNK_ELEMENTS`."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def reshards_after_forward(model: TrainerModelConfig, ranks: int, gpu: bool, offload: bool) -> bool:
    """Whether FSDP2 frees each layer's gathered parameters after its forward pass (``model.reshard_after_forward``).
    ``auto``: yes with several ranks, where gathering is communication; on one GPU, where it is a copy, the copies
    are kept in full training, but freed under LoRA (they would hold the frozen base twice) and under CPU offload
    (they would hold every layer on the GPU); on the CPU freed, as keeping them was no faster there."""
    if model.reshard_after_forward != "auto":
        return model.reshard_after_forward
    return ranks > 1 or not gpu or model.experimental.lora is not None or offload


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
        plan["vision"] = vision_activation_bytes(shape.vision, trainer.micro_batch_budget, compute, vision_trained)
    if in_4bit:  # each 4-bit linear is dequantized to the compute dtype to multiply, one at a time
        plan["dequantized"] = max(max(quantized_linears(shape, sparse)) for sparse in layer_kinds(shape)) * compute
    backend = broadcast_backend(trainer, gpu)
    held = trainer_broadcast_bytes(shape, backend, compute, gpu) if backend else 0
    if held:
        plan["broadcast"] = held
    if trainer.weights.delta != "off" and not gpu:  # the copy deltas are taken against (host memory on a GPU)
        plan["delta_copy"] = shape.parameters * compute
    plan = {name: value / GIB for name, value in plan.items()}
    if gpu:
        plan["allocator"] = ALLOCATOR_SLACK * plan["activations"]
        plan["cuda"] = CUDA_CONTEXT_GIB
    plan["total"] = sum(plan.values())
    if host := offloaded_bytes(shape, trainer, compute):  # in host memory, not the GPU's
        plan["host"] = host / GIB
    return plan


def vision_block_activation_bytes(vision: VisionShape, compute: int) -> int:
    """Bytes one patch keeps for the backward pass of one vision block (read with ``saved_tensors_hooks`` in
    bf16): the inputs of its norms and linear layers, q, k and v (and q and k in float32 for the rotary
    embedding), the attention's output, the MLP's activation input, the norms' statistics and the
    attention's log-sum-exp."""
    h, i = vision.hidden_size, vision.intermediate_size
    return compute * (8 * h + 2 * i) + 4 * 2 * h + 16 + 4 * vision.num_heads


def vision_activation_bytes(vision: VisionShape, tokens: int, compute: int, trained: bool) -> int:
    """Bytes of a vision tower's activations for ``tokens`` image tokens (``spatial_merge_size²`` patches each): kept
    through the backward pass where it trains (every block's, the mergers' inputs and the patches), else one
    block's at a time in its forward pass; and the image tokens' embeddings (the merger's and the DeepStack
    mergers'), which the language model's forward pass reads."""
    patches = tokens * vision.spatial_merge_size**2
    embeddings = tokens * (1 + vision.deepstack_mergers) * vision.out_hidden_size * compute
    if not trained:
        return patches * vision_block_activation_bytes(vision, compute) + embeddings
    mergers = (1 + vision.deepstack_mergers) * 4 * vision.hidden_size * compute
    kept = vision.depth * vision_block_activation_bytes(vision, compute) + mergers + vision.patch_features * compute
    return patches * kept + embeddings
