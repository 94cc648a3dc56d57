"""GPU check: the trainer's own code on random Qwen3-shaped models, each model in its own process.

    uv run python benchmarks/gpu_check.py                 # on a GPU machine: writes results/gpu_check.json
    uv run python benchmarks/gpu_check.py --smoke         # the same path on CPU with tiny shapes (CI)
    python3 benchmarks/gpu_check.py --baseline-src OLD/src   # also runs an older trainer, alternated with this one

Each model is built once as random weights on disk (a tiny model is used as built); a case process then runs what
the trainer runs per step (``init_world``, ``build_model``, ``build_optimizer``, samples packed by ``pack_samples``
into micro-batches of the case's ``seq_len``, or one, and packed anew into ``micro_batch_tokens`` where the case sets
it, ``train_step``) on each of its batch sizes, small first: two warm-up steps (where compiled layers compile), then
timed steps. Each result says which speed settings applied (compiled layers, micro-batch tokens, FSDP resharding, the
checkpointed part, a mixture of experts' implementation): ``qwen3-0.6b-full`` against ``qwen3-0.6b-eager`` measures
the compiled layers, ``qwen3-0.6b-short-samples`` against a baseline the token budget, ``qwen3-8b-lora-ac-mlp``
against ``qwen3-8b-lora`` checkpointing the MLP only. The long-sample cases train one 65,536-token sample of 8B
under LoRA: ``...-64k-offload`` against ``qwen3-8b-lora-64k`` measures activation offload (memory saved, time
spent), ``...-64k-cp2`` context parallelism over two GPUs (under torchrun; skipped on one GPU).
The mixture-of-experts cases run four layers of Qwen3-30B-A3B's shape (128 experts, 8 a token), full and under LoRA
on attention and experts, with transformers' grouped-GEMM experts (``grouped_mm``, one kernel for all experts)
against its eager loop over experts (``...-eager``).

It reports seconds per step, tokens/s, model FLOP/s against the chip's measured bf16 matrix-product rate (MFU: 6·N
per token for full training, 4·N for LoRA, attention left out; N of a mixture of experts counts the experts a token
is routed to), peak allocated and reserved memory and the device
memory in use, against ``rl``'s memory plan for the same run, and the time to export weights (the adapter under
LoRA, full weights otherwise). A last process pair hands a model's bf16 weights from one process to another as the
trainer and the server's worker do on one device (``[weight_broadcast] backend = "shared"``: the trainer's
``SharedBufferSender`` writes them into a buffer the other process maps, by CUDA IPC on a GPU or in ``/dev/shm`` on
the CPU, and that process copies them into its own tensors): the same-device weight handover, timed on both sides.

With ``--baseline-src`` every case runs twice, in alternating order, once importing ``trainer`` and ``rl`` from
that folder (an older checkout's ``src``): old and new measured side by side on the same machine.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
RESULT_PREFIX = "GPU_CHECK_RESULT "
WARMUP_STEPS, TIMED_STEPS = 2, 5
HANDOVERS = 4  # the first also attaches the receiver to the buffer and allocates its weights
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Case:
    """One model and how it trains, with the batches it is timed on: (samples, tokens per sample) each, packed
    into micro-batches of ``seq_len`` tokens (None: the whole batch in one), which a trainer that has the setting
    packs anew into ``micro_batch_tokens``. Settings an older trainer lacks (``--baseline-src``) are left out on
    its side: a case's result says which applied."""

    shape: str  # a key of contracts.model_card.KNOWN_SHAPES, or a tiny model's id ("trident/tiny-qwen3")
    batches: list[tuple[int, int]]
    layers: int | None = None  # the shape's first layers only; None: all of them
    experts: str | None = None  # a mixture of experts' implementation in transformers: "grouped_mm" or "eager"
    lora_rank: int | None = None  # LoRA on all seven linears; None: full fine-tune
    ac_freq: int | None = None  # activation checkpointing every ac_freq layers; None: off
    ac_part: str | None = None  # what of a checkpointed layer is recomputed; None: the trainer's default
    seq_len: int | None = None
    micro_batch_tokens: int | None = None
    compile: bool | None = None  # None: the trainer's default (on a GPU in bf16: compiled layers)
    ac_offload: bool = False  # checkpointed layers' inputs in host memory (model.ac.offload)
    cp: int = 1  # context parallelism: ranks (GPUs, torchrun) each micro-batch's tokens are split over

    @property
    def model_key(self) -> str:
        """The random model this case trains: its shape, cut to its layers."""
        return self.shape + (f"-{self.layers}-layers" if self.layers else "")

    def model_config(
        self, model_dir: str, known: set[str] = frozenset({"ac.part", "ac.offload", "compile", "parallel.cp"})
    ) -> dict:
        """The trainer's ``model`` section, with the settings in ``known`` (what the trainer has) only."""
        config = {"name": model_dir}
        if self.lora_rank is not None:
            config["experimental"] = {"lora": {"rank": self.lora_rank, "target_modules": ALL_LINEARS}}
        if self.ac_freq is not None:
            config["ac"] = {"freq": self.ac_freq} | ({"part": self.ac_part} if self.ac_part and "ac.part" in known
                                                      else {})  # fmt: skip
            if self.ac_offload and "ac.offload" in known:
                config["ac"]["offload"] = True
        if self.compile is not None and "compile" in known:
            config["compile"] = self.compile
        if self.cp > 1 and "parallel.cp" in known:
            config["parallel"] = {"cp": self.cp}
        return config


CASES = {
    "qwen3-0.6b-full": Case("Qwen3-0.6B", [(8, 1024), (64, 128)]),  # compiled layers where the trainer has them
    "qwen3-0.6b-eager": Case("Qwen3-0.6B", [(8, 1024), (64, 128)], compile=False),
    # short samples: 8 micro-batches of seq_len, or one of micro_batch_tokens where the trainer has it
    "qwen3-0.6b-short-samples": Case("Qwen3-0.6B", [(64, 128)], seq_len=1024, micro_batch_tokens=8192),
    "qwen3-8b-lora": Case("Qwen3-8B", [(4, 2048), (8, 2048)], lora_rank=4, ac_freq=1),  # seed 004's layout
    "qwen3-8b-lora-ac-mlp": Case("Qwen3-8B", [(4, 2048), (8, 2048)], lora_rank=4, ac_freq=1, ac_part="mlp"),
    # four layers of Qwen3-30B-A3B (3.1B parameters, 2.4B of them in experts): grouped GEMM against the eager loop
    "qwen3-30b-a3b-4l-full": Case("Qwen3-30B-A3B", [(4, 2048)], layers=4, experts="grouped_mm"),
    "qwen3-30b-a3b-4l-full-eager": Case("Qwen3-30B-A3B", [(4, 2048)], layers=4, experts="eager"),
    "qwen3-30b-a3b-4l-lora": Case(
        "Qwen3-30B-A3B", [(4, 2048), (8, 2048)], layers=4, experts="grouped_mm", lora_rank=4, ac_freq=1
    ),
    "qwen3-30b-a3b-4l-lora-eager": Case(
        "Qwen3-30B-A3B", [(4, 2048), (8, 2048)], layers=4, experts="eager", lora_rank=4, ac_freq=1
    ),
    # one 65,536-token sample (a long agent trace), 8B LoRA, every layer checkpointed: the layers' inputs kept on the
    # GPU, offloaded to host memory, and (on two GPUs; skipped on one) the sample's tokens split over both
    "qwen3-8b-lora-64k": Case("Qwen3-8B", [(1, 65_536)], lora_rank=4, ac_freq=1),
    "qwen3-8b-lora-64k-offload": Case("Qwen3-8B", [(1, 65_536)], lora_rank=4, ac_freq=1, ac_offload=True),
    "qwen3-8b-lora-64k-cp2": Case("Qwen3-8B", [(1, 65_536)], lora_rank=4, ac_freq=1, cp=2),
}
TINY, TINY_MOE = "trident/tiny-qwen3", "trident/tiny-qwen3-moe"
SMOKE_CASES = {
    "tiny-full": Case(TINY, [(4, 64), (16, 16)]),
    "tiny-lora": Case(TINY, [(4, 64)], lora_rank=4, ac_freq=1),
    "tiny-short-samples": Case(TINY, [(16, 16)], ac_freq=1, ac_part="mlp", seq_len=64, micro_batch_tokens=256),
    # the MoE path at its smallest: the tiny MoE, LoRA on attention and experts, grouped GEMM, one small batch
    "tiny-moe-lora": Case(TINY_MOE, [(4, 16)], experts="grouped_mm", lora_rank=4),
    "tiny-lora-long-offload": Case(TINY, [(1, 512)], lora_rank=4, ac_freq=1, ac_offload=True),
}
HANDOVER_SHAPES = {"full": ["Qwen3-0.6B", "Qwen3-8B"], "smoke": [TINY]}


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# --- in a case process -------------------------------------------------------------------------------------------


def qwen3_config(shape: str, layers: int | None = None):
    """A transformers Qwen3 (or Qwen3-MoE) config of ``shape`` (a known hub model's, or a tiny model's own), of its
    first ``layers`` only where given."""
    from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

    from contracts.model_card import KNOWN_SHAPES
    from tools.tiny_model import built_model_path

    if shape not in KNOWN_SHAPES:
        config = AutoConfig.from_pretrained(built_model_path(shape))
        config.num_hidden_layers = layers or config.num_hidden_layers
        return config
    s = KNOWN_SHAPES[shape]
    common = dict(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=layers or s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, tie_word_embeddings=s.tie_word_embeddings,
        max_position_embeddings=40_960,
    )  # fmt: skip
    if not s.num_experts:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(**common, num_experts=s.num_experts, num_experts_per_tok=s.num_experts_per_tok,
                          moe_intermediate_size=s.moe_intermediate_size, norm_topk_prob=True)  # fmt: skip


def make_model(shape: str, folder: Path, layers: int | None = None) -> dict:
    """Save random weights of ``shape`` (its first ``layers``; bf16, made on the GPU when there is one) with the tiny
    model's tokenizer into ``folder``; also time bf16 matrix products, the rate MFU is measured against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contracts.model_path import TINY_MODEL_ID
    from tools.tiny_model import built_model_path

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_config(shape, layers), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(built_model_path(TINY_MODEL_ID)).save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()), "matmul_tflops": matmul_tflops(device)}


def matmul_tflops(device: str) -> float | None:
    """Measured bf16 TFLOP/s of a large matrix product on the GPU (None on CPU)."""
    import torch

    if device != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def random_samples(count: int, length: int, vocab_size: int, seed: int):
    """``count`` samples of ``length`` tokens: a quarter prompt, the rest a completion under the loss mask with
    logprobs near a random model's."""
    import math

    import torch

    from contracts.protocol import Sample

    generator = torch.Generator().manual_seed(seed)
    prompt = length // 4
    samples = []
    for _ in range(count):
        tokens = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        logprobs = (-math.log(vocab_size) + 0.05 * torch.randn(length - prompt, generator=generator)).tolist()
        advantage = float(torch.randn(1, generator=generator))
        samples.append(Sample(tokens, [False] * prompt + [True] * (length - prompt), [0.0] * prompt + logprobs,
                              advantage, 0.0, 0))  # fmt: skip
    return samples


def memory_now(device) -> dict:
    """Peak allocated and reserved memory since the last reset, and what the device has in use (GiB)."""
    import torch

    if device.type != "cuda":
        from trainer.train import peak_memory_gib

        return {"peak_rss_gib": peak_memory_gib(device)}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "device_used_gib": (total - free) / 2**30,
    }


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, model_dir: str) -> dict:
    """Train ``case``'s model on each of its batches with the trainer's own functions; time steps and export."""
    import torch
    from transformers import AutoTokenizer

    import contracts.protocol
    from contracts.protocol import BatchInfo, MicroBatch, pack_samples
    from trainer.config import ActivationCheckpointConfig, TrainerConfig, TrainerModelConfig
    from trainer.export import save_weights
    from trainer.optim import build_optimizer
    from trainer.parallel import close_world, init_world, rank_share
    from trainer.train import build_model, compute_dtype, train_step

    world = init_world(case.cp) if case.cp > 1 else init_world()
    try:
        known = {"compile"} & set(TrainerModelConfig.model_fields)
        known |= {"ac.part", "ac.offload"} & {f"ac.{name}" for name in ActivationCheckpointConfig.model_fields}
        known |= {"parallel.cp"} if case.cp > 1 else set()
        budget = case.micro_batch_tokens if "micro_batch_tokens" in TrainerConfig.model_fields else None
        seq_len = case.seq_len or max(n * length for n, length in case.batches)
        config = TrainerConfig(model=case.model_config(model_dir, known), seq_len=seq_len,
                               **({"micro_batch_tokens": budget} if budget else {}))  # fmt: skip
        start = time.perf_counter()
        torch.manual_seed(0)
        model = build_model(config.model, world, config.optim.offload)
        if case.experts:
            use_experts(model, case.experts)
        optimizer, _ = build_optimizer(model, config.optim, 1000)
        sync(world.device)
        result = {"build_s": time.perf_counter() - start, "batches": []}
        for count, length in case.batches:
            samples = random_samples(count, length, model.config.vocab_size, seed=count)
            micro_batches = [MicroBatch.pack(b) for b in pack_samples(samples, case.seq_len or count * length)]
            if budget:
                micro_batches = contracts.protocol.repack(micro_batches, budget)  # as the trainer does after reading
            tokens = count * length
            info = BatchInfo(0, count, tokens, sum(sum(s.loss_mask) for s in samples), 0.0, 1.0)
            if world.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(world.device)
            seconds, metrics = [], {}
            for _ in range(WARMUP_STEPS + TIMED_STEPS):
                sync(world.device)
                start = time.perf_counter()
                metrics = train_step(model, optimizer, rank_share(micro_batches, world), info, config, world)
                sync(world.device)
                seconds.append(time.perf_counter() - start)
            warmup, seconds = seconds[:WARMUP_STEPS], seconds[WARMUP_STEPS:]  # warm-up: compilation, allocator
            step_s = statistics.median(seconds)
            result["batches"].append({"samples": count, "tokens_per_sample": length, "tokens": tokens,
                                      "micro_batches": len(micro_batches), "warmup_seconds": warmup,
                                      "step_seconds": seconds,
                                      "s_per_step": step_s, "tokens_per_s": tokens / step_s, "loss": metrics["loss"],
                                      **memory_now(world.device)})  # fmt: skip
        result["applied"] = applied(model, config, world)  # after the steps: layers that fell back to eager are eager
        export = "adapter" if case.lora_rank is not None else "merged"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with tempfile.TemporaryDirectory(prefix="gpu-check-weights-") as folder:
            sync(world.device)
            start = time.perf_counter()
            save_weights(model, tokenizer, Path(folder) / "step_1", export, None, compute_dtype("auto", world.device))
            result["export"] = {"kind": export, "seconds": time.perf_counter() - start}
        result["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return result
    finally:
        close_world()


def use_experts(model, implementation: str) -> None:
    """Run the model's mixture-of-experts layers with transformers' ``implementation`` of its experts."""
    from transformers import PreTrainedModel

    next(m for m in model.modules() if isinstance(m, PreTrainedModel)).set_experts_implementation(implementation)


def applied(model, config, world) -> dict:
    """The speed settings that took effect in this trainer: compiled layers, micro-batch tokens, and whether FSDP
    reshards the layers after forward (what an older trainer lacks is reported as it behaved)."""
    from trainer.model import decoder_layers

    layer = decoder_layers(model)[0]
    model_config = config.model
    reshard = True  # FSDP2's default for the layers, before the setting existed
    if "reshard_after_forward" in type(model_config).model_fields:
        import trainer.config
        import trainer.parallel

        try:  # in trainer.plan now; in trainer.config or trainer.parallel in an older trainer
            from trainer.plan import reshards_after_forward as decide
        except ImportError:
            decide = getattr(trainer.config, "reshards_after_forward", None) or trainer.parallel.reshards_after_forward
        reshard = decide(model_config, world.size, world.device.type == "cuda", config.optim.offload)
    return {
        "compiled": getattr(layer, "_compiled_call_impl", None) is not None,
        "micro_batch_tokens": getattr(config, "micro_batch_tokens", None),
        "reshard_after_forward": reshard,
        "ac_part": getattr(model_config.ac, "part", "layer") if model_config.ac else None,
        "ac_offload": getattr(model_config.ac, "offload", False) if model_config.ac else False,
        "cp": getattr(world, "cp", 1),
        "experts": model.config._experts_implementation if model.config.model_type.endswith("moe") else None,
    }


def handover_receive(manifests) -> None:
    """The server's worker's side of the shared-buffer handover, as ``inference.worker`` does it: attach to the
    buffer once, copy each step's tensors out of it into its own weights (allocated at the first), say so."""
    import torch

    from contracts.weight_manifest import taken_key
    from inference.transports.shared_buffer import SharedBufferReceiver

    receiver = own = None
    while (manifest := manifests.get()) is not None:
        start = time.perf_counter()
        if receiver is None:
            receiver = SharedBufferReceiver(manifest)
        tensors = receiver.read(manifest["tensors"])
        if own is None:
            own = {name: torch.empty_like(tensor) for name, tensor in tensors}
        for name, tensor in tensors:
            own[name].copy_(tensor)
        sync(next(iter(own.values())).device)
        receiver.store.set(taken_key(manifest), f"{time.perf_counter() - start:.6f}")


def run_handover(shape: str) -> dict:
    """The bf16 weights of ``shape`` handed from this process (the trainer's ``SharedBufferSender``, ``backend =
    "shared"``) to a second one (the worker's side) through the shared buffer, :data:`HANDOVERS` times."""
    import socket

    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from contracts.weight_manifest import taken_key
    from trainer.transports import memory_sender

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.bfloat16)
    weights = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = memory_sender("127.0.0.1", port, 600.0, "shared", device)
    context = mp.get_context("spawn")
    manifests = context.Queue()
    receiver = context.Process(target=handover_receive, args=(manifests,))
    receiver.start()
    write_s, take_s = [], []
    for _ in range(HANDOVERS):
        start = time.perf_counter()
        manifest = sender.offer(weights)  # after the previous weights were taken: written into the buffer
        write_s.append(time.perf_counter() - start)
        manifests.put(manifest)
        sender.wait()
        take_s.append(float(sender.store.get(taken_key(manifest))))
    manifests.put(None)
    receiver.join(timeout=60)
    sender.close()
    size = sum(t.numel() * t.element_size() for t in weights.values())
    return {"shape": shape, "tensors": len(weights), "gib": size / 2**30, "transport": manifest["buffer"]["kind"],
            "write_s": write_s, "take_s": take_s}  # fmt: skip


def case_main(argv: list[str]) -> None:
    """``gpu_check.py case|make|handover ...`` in a child process: print one result line."""
    action, payload = argv[0], json.loads(argv[1])
    if action == "make":
        result = make_model(payload["shape"], Path(payload["folder"]), payload.get("layers"))
    elif action == "handover":
        result = run_handover(payload["shape"])
    else:
        result = run_case(Case(**payload["case"]), payload["model_dir"])
    if os.environ.get("RANK", "0") == "0":  # under torchrun (a context-parallel case), rank 0's
        print(RESULT_PREFIX + json.dumps(result), flush=True)


# --- the parent ----------------------------------------------------------------------------------------------------


def child(action: str, payload: dict, src: Path, timeout_s: float, ranks: int = 1) -> dict:
    """Run one action of this script in a fresh process (``ranks`` > 1: that many, under torchrun) with ``src`` first
    on its path; its result line."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    argv = [sys.executable, *torchrun, __file__, action, json.dumps(payload)]
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise RuntimeError(f"{action} {payload} failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) | {"process_s": time.perf_counter() - started}


def tiny_model(name: str) -> dict:
    """A tiny model's own folder, built once with random weights (:mod:`tools.tiny_model`): none to make."""
    from contracts.model_card import ModelCard
    from tools.tiny_model import built_model_path

    folder = built_model_path(name)
    return {"folder": folder, "parameters": ModelCard.of(folder).hub_shape().parameters, "matmul_tflops": None}


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def planned(case: Case, model_dir: str, tokens: int, applied: dict, gpu: bool) -> dict:
    """``rl``'s memory plan of the trainer for this case as it ran (its ``applied`` settings), on a batch of
    ``tokens`` (GiB)."""
    from contracts.model_card import ModelCard
    from trainer.config import TrainerConfig
    from trainer.plan import trainer_plan

    model = case.model_config(model_dir) | {"reshard_after_forward": applied["reshard_after_forward"]}
    if model.get("ac"):
        model["ac"] = model["ac"] | {"part": applied["ac_part"], "offload": applied.get("ac_offload", False)}
    config = TrainerConfig(
        model=model, seq_len=case.seq_len or tokens, micro_batch_tokens=applied["micro_batch_tokens"]
    )
    return trainer_plan(ModelCard.of(model_dir).hub_shape(), config, ranks=case.cp, gpu=gpu)


def summarise(case: Case, result: dict, parameters: int, matmul: float | None, model_dir: str, gpu: bool) -> None:
    """Add MFU and the memory plan to each of a case's batches, in place. The FLOPs of a mixture of experts are those
    of its parameters a token uses: the routed experts' share ``num_experts_per_tok / num_experts``."""
    from contracts.model_card import ModelCard

    shape = ModelCard.of(model_dir).hub_shape()
    unused = shape.expert_parameters * (1 - shape.num_experts_per_tok / shape.num_experts) if shape.num_experts else 0
    flops_per_token = (4 if case.lora_rank is not None else 6) * (parameters - unused)
    for batch in result["batches"]:
        batch["model_tflops"] = flops_per_token * batch["tokens_per_s"] / 1e12
        if matmul:
            batch["mfu"] = batch["model_tflops"] / matmul
        plan = planned(case, model_dir, batch["tokens"], result["applied"], gpu)
        batch["plan_gib"] = plan["total"]
        if gpu:
            batch["plan_over_device_used"] = plan["total"] / batch["device_used_gib"]


def table(results: dict) -> str:
    rows = [f"{'case':24}{'side':10}{'tokens':>8}{'s/step':>9}{'tokens/s':>10}{'MFU':>7}{'peak GiB':>10}"
            f"{'used GiB':>10}{'plan GiB':>10}"]  # fmt: skip
    for name, sides in results["cases"].items():
        for side, result in sides.items():
            for b in result["batches"]:
                mfu = f"{b['mfu']:.0%}" if "mfu" in b else "-"
                peak, used = b.get("peak_allocated_gib", b.get("peak_rss_gib")), b.get("device_used_gib", 0)
                rows.append(f"{name:24}{side:10}{b['tokens']:>8}{b['s_per_step']:>9.3f}{b['tokens_per_s']:>10.0f}"
                            f"{mfu:>7}{peak:>10.1f}{used:>10.1f}{b['plan_gib']:>10.1f}")  # fmt: skip
            settings = result.get("applied", {})
            rows.append(f"{'':34}export {result['export']['kind']}: {result['export']['seconds']:.2f}s; "
                        + ", ".join(f"{key} {value}" for key, value in settings.items()))  # fmt: skip
    for handover in results["handover"]:
        rows.append(
            f"handover {handover['shape']} ({handover['gib']:.1f} GiB, {handover['tensors']} tensors, "
            f"{handover['transport']}): write {statistics.median(handover['write_s']):.3f}s, "
            f"take {statistics.median(handover['take_s'][1:]):.3f}s (first {handover['take_s'][0]:.2f}s)"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device there is (CI)")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "gpu_check.json")
    parser.add_argument("--baseline-src", type=Path, help="an older checkout's src/, run alternated with this one")
    parser.add_argument("--cases", nargs="*", help="run only these cases")
    parser.add_argument("--no-handover", action="store_true", help="skip the weight handover between processes")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per child process")
    args = parser.parse_args(argv)
    from contracts.model_card import KNOWN_SHAPES

    cases = SMOKE_CASES if args.smoke else CASES
    cases = {name: case for name, case in cases.items() if not args.cases or name in args.cases}
    sides = {"new": SRC} | ({"baseline": args.baseline_src.resolve()} if args.baseline_src else {})
    gpu = _has_gpu()
    os.environ.setdefault("OMP_NUM_THREADS", "8" if gpu else "1")  # the children's, as rl gives its processes
    results = {"benchmark": "gpu_check", "date": utc_now(), "device": device_name(), "host": platform.node(),
               "smoke": args.smoke, "warmup_steps": WARMUP_STEPS, "timed_steps": TIMED_STEPS, "cases": {},
               "handover": []}  # fmt: skip
    errors = []

    def attempt(action: str, payload: dict, src: Path, ranks: int = 1) -> dict | None:
        """A child's result, or None with its failure kept (the check goes on with the other parts)."""
        try:
            return child(action, payload, src, args.timeout_s, ranks)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            errors.append(f"{action}: {e}")
            print(f"FAILED {errors[-1]}", flush=True)
            return None

    def save() -> None:  # after each part: a check cut short still leaves what it measured
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results | {"errors": errors}, indent=1) + "\n")

    for shape in [] if args.no_handover else HANDOVER_SHAPES["smoke" if args.smoke else "full"]:
        if handover := attempt("handover", {"shape": shape}, SRC):
            results["handover"].append(handover)
        save()
    with tempfile.TemporaryDirectory(prefix="gpu-check-models-") as tmp:
        models = {}
        for i, (name, case) in enumerate(cases.items()):
            key = case.model_key
            if key not in models and case.shape not in KNOWN_SHAPES:
                models[key] = tiny_model(case.shape)
            elif key not in models:  # made just before its first case: a cut-short check has the cases before
                folder = Path(tmp) / key
                make = {"shape": case.shape, "folder": str(folder), "layers": case.layers}
                models[key] = attempt("make", make, SRC) or {}
                models[key]["folder"] = str(folder)
                results["matmul_tflops"] = results.get("matmul_tflops") or models[key].get("matmul_tflops")
            model = models[key]
            if "parameters" not in model:
                continue
            if case.cp > 1 and gpus() < case.cp:
                print(f"{name}: skipped (cp {case.cp} needs {case.cp} GPUs, this machine has {gpus()})", flush=True)
                continue
            order = list(sides) if i % 2 == 0 else list(reversed(sides))  # alternate which side goes first
            results["cases"][name] = {}
            for side in order:
                result = attempt("case", {"case": asdict(case), "model_dir": model["folder"]}, sides[side], case.cp)
                if result is None:
                    continue
                summarise(case, result, model["parameters"], model["matmul_tflops"], model["folder"], gpu)
                results["cases"][name][side] = result
                save()
                print(f"{name} ({side}): " + ", ".join(f"{b['tokens']} tokens {b['s_per_step']:.3f} s/step"
                                                       for b in result["batches"]), flush=True)  # fmt: skip
    save()
    print(table(results))
    print(f"results: {args.output}")
    if errors:
        sys.exit(f"{len(errors)} part(s) of the check failed: see 'errors' in {args.output}")
    return results


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("case", "make", "handover"):
        case_main(sys.argv[1:])
    else:
        main()
