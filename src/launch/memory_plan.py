"""A memory plan for a run: what each trainer rank and each inference server need on each GPU, before anything
starts, summed per GPU and printed.

Each process owns its figure, arithmetic on the model card's shape and its config (no weights are loaded): the
trainer's :func:`trainer.plan.trainer_plan`, the server's :func:`inference.plan.inference_plan`. This module places
them on the GPUs, names what does not fit, and the context parallelism that would make the trainer fit.
"""

from dataclasses import dataclass, replace

from contracts.errors import TridentError
from contracts.model_card import ModelCard, ModelShape
from inference.config import InferenceConfig
from inference.plan import inference_plan
from trainer.config import ParallelConfig, TrainerConfig
from trainer.plan import broadcast_backend, trainer_plan


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
    teacher: dict[str, float] | None = None  # the teacher's server rl starts, as ``inference``

    def total(self, process: str) -> float:
        """GiB of ``process`` on each of its GPUs: the trainer's counted once per run."""
        return getattr(self, process)["total"] * (self.runs if process == "trainer" else 1)

    def problems(self) -> list[str]:
        """Each way the plan does not fit, as a line naming the number at fault."""
        if self.gpu_gib is None:
            return []
        found = []
        held = ("weights", "kv_one_context", "adapters")
        for process, key in (("inference", "inference"), ("teacher", "teacher_")):
            server = getattr(self, process)
            if server and sum(server.get(part, 0) for part in held) > server["claimed"]:
                slots = f", its LoRA slots ({size(server['adapters'])})" if "adapters" in server else ""
                found.append(
                    f"{process}: vLLM's share ({size(server['claimed'])}, {key}gpu_memory_utilization of "
                    f"{size(self.gpu_gib)}) cannot hold its weights ({size(server['weights'])}){slots} and one "
                    f"max_model_len context of KV cache ({size(server['kv_one_context'])})"
                )
        for gpu, processes in self.gpus.items():
            need = sum(self.total(process) for process in processes)
            if need > self.gpu_gib:
                parts = " + ".join(f"{self.process_label(p)} {size(self.total(p))}" for p in processes)
                found.append(
                    f"GPU {gpu}: {parts} = {size(need)} does not fit in its {size(self.gpu_gib)} "
                    f"(trainer: {self.describe('trainer')})"
                )
                if "teacher" in processes and "inference" in processes:
                    found.append("lower --teacher-gpu-memory-utilization and inference.gpu_memory_utilization, or "
                                 "give the teacher GPUs of its own (--teacher-gpu-ids)")  # fmt: skip
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
        if self.teacher:
            held = (
                size(self.teacher["total"])
                if self.gpu_gib is None
                else f"{size(self.teacher['claimed'])} claimed by vLLM"
            )
            lines.append(f"  teacher: {held} ({self.describe('teacher')})")
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
    teacher: InferenceConfig | None = None,
    teacher_gpus: list[int] | None = None,
) -> MemoryPlan:
    """The memory plan of a run whose trainer ranks use ``trainer_gpus``, whose server (when ``rl`` starts
    one) uses ``inference_gpus`` and whose teacher's server (``teacher``, when rl starts one) ``teacher_gpus``, each
    GPU of ``gpu_gib`` GiB (None: no GPUs, everything on the CPU)."""
    shape = ModelCard.of(trainer.model.name).hub_shape()
    gpu = gpu_gib is not None
    ranks, ep = len(trainer_gpus) if gpu else 1, trainer.model.parallel.ep
    trainer_part = trainer_plan(shape, trainer, ranks, gpu)
    broadcast = broadcast_backend(trainer, gpu)
    inference_part = inference_plan(shape, inference, gpu_gib, broadcast) if inference is not None else None
    teacher_part = None
    if teacher is not None:
        try:
            teacher_part = inference_plan(ModelCard.of(teacher.model.name).hub_shape(), teacher, gpu_gib)
        except TridentError as e:
            raise TridentError(f"orchestrator.teacher.model: {e}") from None
    gpus: dict[int, list[str]] = {}
    if gpu:
        for gpu_id in trainer_gpus:
            gpus.setdefault(gpu_id, []).append("trainer")
        for gpu_id in inference_gpus if inference_part else []:
            gpus.setdefault(gpu_id, []).append("inference")
        for gpu_id in (teacher_gpus or []) if teacher_part else []:
            gpus.setdefault(gpu_id, []).append("teacher")
    plan = MemoryPlan(gpu_gib, trainer_part, inference_part, dict(sorted(gpus.items())), shape.num_experts, ep,
                      cp=trainer.model.parallel.cp, tokens=trainer.micro_batch_budget,
                      teacher=teacher_part)  # fmt: skip
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
